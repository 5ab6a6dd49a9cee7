"""What runs inside a function, and on this machine under `cloudless-run`.

Torch and the standard library only (plus boto3 or redis for those channels). Relative imports
among these modules, and of Cloudless only the `cloudless.ir` modules of the run contract (workflow,
schedule, protocol): the compiler copies those and the function's modules into every package under
the same names (`cloudless/runtimes/`, `cloudless/ir/`).
"""
