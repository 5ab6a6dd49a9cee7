"""The tests' Lambda invokes for the ASL interpreter (cloudless.runtimes.rehearsal.asl): the generated handlers run
in this process (InProcessLambda) or each invocation in a cold `python handler.py` process (ProcessLambda).
The rehearsal's own invoke, through the runtime interface client, is cloudless.runtimes.rehearsal.lambda_local."""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from cloudless.runtimes.rehearsal.asl import FunctionError


class ProcessLambda:
    """The Lambda invoke of an execution, run on this machine: each invocation runs the function's
    generated `handler.py PAYLOAD` in a new Python process (a cold function) with the deployment's
    environment (storage), and its result is the handler's return value (the last line of stdout). A
    handler that raises is a FunctionError named after the exception's type, as Lambda reports it."""

    def __init__(self, packages: dict[str, Path], environment: dict[str, str], logs: Path) -> None:
        self.packages, self.environment, self.logs = packages, environment, logs
        logs.mkdir(parents=True, exist_ok=True)
        self._count = itertools.count()

    def __call__(self, function: str, payload: Any) -> Any:
        package = self.packages.get(function)
        if package is None:
            raise FunctionError("Lambda.ResourceNotFoundException", f"Function not found: {function}")
        env = {**os.environ, **self.environment, "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
        stem = f"{package.name}-{next(self._count)}"
        with (self.logs / f"{stem}.log").open("wb") as log:
            done = subprocess.run(
                [sys.executable, str(package / "handler.py"), json.dumps(payload)],
                stdout=subprocess.PIPE,
                stderr=log,
                env=env,
                cwd=package,
                check=False,
            )
        if done.returncode != 0:
            lines = [x for x in (self.logs / f"{stem}.log").read_text(errors="replace").splitlines() if x.strip()]
            last = lines[-1] if lines else f"exit status {done.returncode}"
            error, _, message = last.partition(": ")
            if not re.fullmatch(r"[\w.]+", error):
                error, message = "Lambda.Unknown", last
            raise FunctionError(error.rsplit(".", 1)[-1], json.dumps({"errorMessage": message}))
        out = [x for x in done.stdout.decode().splitlines() if x.strip()]
        return json.loads(out[-1])


class InProcessLambda:
    """The Lambda invoke run in this process (warm functions): `handlers` maps each function name to its
    loaded handler module, whose `handler(event, context)` runs in the calling thread; what it raises
    is a FunctionError named after the exception's type."""

    def __init__(self, handlers: dict[str, Any]) -> None:
        self.handlers = handlers

    def __call__(self, function: str, payload: Any) -> Any:
        module = self.handlers.get(function)
        if module is None:
            raise FunctionError("Lambda.ResourceNotFoundException", f"Function not found: {function}")
        try:
            return json.loads(json.dumps(module.handler(payload, None)))
        except Exception as exc:
            raise FunctionError(type(exc).__name__, json.dumps({"errorMessage": str(exc)})) from exc
