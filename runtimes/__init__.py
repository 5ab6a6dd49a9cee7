"""What runs inside a function, and on this machine under `cloudless-run`.

Torch and the standard library only (plus boto3 or redis for those channels), and relative imports
only: the compiler copies this folder into every function package as `cloudless_runtime`.
"""
