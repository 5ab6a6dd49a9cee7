"""What runs inside a function and the local runner (arrives with the runtime issue)."""
