"""Step Functions for a local AWS endpoint: the executions started on moto, run by the ASL interpreter.

moto records state machines and executions (StartExecution, DescribeExecution, StopExecution) but does
not run them. `StepFunctionsExecutor` watches the state machines of the given regions in moto's backend
(moto's server runs in this process: runtimes/rehearsal/aws.py), runs each new RUNNING execution with
`asl.Execution` over the machine's deployed definition (the ARNs CloudFormation substituted), its Lambda
tasks through `invoke(function, payload)`, and writes the end back into moto's record: SUCCEEDED with the
output, or FAILED with the error and cause, where DescribeExecution reads them. An execution stopped
meanwhile (StopExecution sets ABORTED) is stopped in the interpreter and keeps its ABORTED.
"""

from __future__ import annotations

import json
import threading
from datetime import UTC, datetime
from typing import Any

from .asl import Execution, ExecutionAborted, ExecutionFailed, Invoke

#: how often moto's records are looked at for new executions and stops, seconds
POLL_S = 0.02


class StepFunctionsExecutor:
    """Runs the executions of every state machine in `regions` ((account, AWS region) pairs of moto's
    backends) until closed. `ran` holds every execution it ran (the interpreter's records: calls, events)."""

    def __init__(self, regions: list[tuple[str, str]], invoke: Invoke, *, time_scale: float = 1.0) -> None:
        from moto.stepfunctions.models import stepfunctions_backends

        self.backends = [stepfunctions_backends[account][region] for account, region in regions]
        self.invoke, self.time_scale = invoke, time_scale
        self.ran: list[Execution] = []
        self.errors: list[BaseException] = []
        self._running: dict[str, tuple[Any, Execution]] = {}
        self._handled: set[str] = set()
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="stepfunctions-executor", daemon=True)

    def __enter__(self) -> StepFunctionsExecutor:
        # Executions that were there before are not this executor's (a moto server that outlives it).
        self._handled.update(r.execution_arn for b in self.backends for m in b.state_machines for r in m.executions)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop watching; executions still running are stopped (their invocations under way finish)."""
        self._closed.set()
        if self._thread.is_alive():
            self._thread.join()
        with self._lock:
            for _, execution in self._running.values():
                execution.stop()

    def _loop(self) -> None:
        while not self._closed.is_set():
            for backend in self.backends:
                for machine in list(backend.state_machines):
                    for record in list(machine.executions):
                        self._look_at(machine, record)
            self._closed.wait(POLL_S)

    def _look_at(self, machine: Any, record: Any) -> None:
        arn = record.execution_arn
        with self._lock:
            running = self._running.get(arn)
        if running is not None:
            if record.status != "RUNNING":  # StopExecution
                running[1].stop()
            return
        if record.status != "RUNNING" or arn in self._handled:
            return
        self._handled.add(arn)
        execution = Execution(
            json.loads(machine.definition),
            json.loads(record.execution_input or "{}"),
            self.invoke,
            name=record.name,
            state_machine=machine.arn,
            time_scale=self.time_scale,
        )
        with self._lock:
            self._running[arn] = (record, execution)
            self.ran.append(execution)
        thread = threading.Thread(target=self._run, args=(record, execution), name=f"execution-{record.name}")
        thread.daemon = True
        thread.start()

    def execute(self, record: Any, execution: Execution) -> Any:
        """Run one execution to its end: its output (ExecutionFailed or ExecutionAborted otherwise)."""
        return execution.run()

    def _run(self, record: Any, execution: Execution) -> None:
        try:
            output = self.execute(record, execution)
        except ExecutionAborted:
            pass  # moto's record says ABORTED already
        except ExecutionFailed as exc:
            self._finish(record, "FAILED", error=exc.error, cause=exc.cause)
        except BaseException as exc:  # noqa: BLE001 - the interpreter's own fault: the execution fails with it
            self.errors.append(exc)
            self._finish(record, "FAILED", error="States.Runtime", cause=f"{type(exc).__name__}: {exc}")
        else:
            self._finish(record, "SUCCEEDED", output=output)
        finally:
            with self._lock:
                self._running.pop(record.execution_arn, None)

    @staticmethod
    def _finish(record: Any, status: str, *, output: Any = None, error: str = "", cause: str = "") -> None:
        if record.status != "RUNNING":  # stopped meanwhile: ABORTED stays
            return
        if status == "SUCCEEDED":
            record.output = json.dumps(output)
        else:
            record.error, record.cause = error, cause
        record.stop_date = datetime.now(UTC)
        record.status = status
