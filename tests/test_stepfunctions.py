"""The Step Functions route, offline: the generated state machine (statemachine.asl.json) executed by an
interpreter of its ASL (tests/asl.py), each Task running the generated Lambda handler in a process of its
own with the deployment's environment, storage a real folder. It trains exactly what `cloudless-run`
trains, and a second execution in the same storage trains again (every invocation carries its run name,
attempt and time limit, so the second is no duplicate of the first).

The state machine's own semantics on stub functions: defaults of the input, every worker of an iteration
invoked at once (inline and Distributed Map), Retry on Lambda's transient errors, Catch and Fail on a
function's error, and several regions' machines defaulting to the region's own iteration count."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from cloudless.codegen.platforms import LAMBDA_RETRY_ERRORS, lambda_function_name, logical_id, render_region, workers
from cloudless.ir import protocol
from cloudless.ir.deployment import CARRIED_FIELDS, EXECUTION_FIELDS, RUN_STOPPED_ERROR, ExecutionInput
from cloudless.ir.protocol import STORAGE_ENV, Invocation
from cloudless.ir.workflow import Workflow
from cloudless.runtimes.cli import main as run_main
from cloudless.runtimes.control.staging import trained_state
from cloudless.runtimes.rehearsal.asl import Execution, ExecutionFailed, FunctionError, substitute
from cloudless.runtimes.rehearsal.openfaas_gateway import load_handler
from cloudless.runtimes.storage.channels import DirectoryChannel
from tests.asl import InProcessLambda, ProcessLambda
from tests.conftest import TWO_STAGE_ITERATIONS
from tests.runtime_cases import MLP, reference_training, write_training_data
from tests.test_platforms import EAST, WEST, make_workflow

ITERATIONS = TWO_STAGE_ITERATIONS  # the two_stages build's (tests/conftest.py)
ACCOUNT = "123456789012"


def arn(function: str, region: str) -> str:
    return f"arn:aws:lambda:us-east-1:{ACCOUNT}:function:{lambda_function_name(function, region)}"


def definition(workflow: Workflow, region: str, iteration_s: float | None = None) -> dict[str, Any]:
    """The region's state machine with SAM's substitutions made (each function's ARN). `iteration_s`: the
    predicted time per iteration (None: one iteration per invocation)."""
    text = render_region(workflow, region, {"sam"}, iteration_s=iteration_s)[f"regions/{region}/statemachine.asl.json"]
    functions = workflow.region(region).functions
    return substitute(text, {f"{logical_id(f.name)}Arn": arn(f.name, region) for f in functions})


def local_state(build: Path, workflow: Workflow, result: Any, tmp_path: Path) -> dict[str, torch.Tensor]:
    """What `cloudless-run` trains (local processes, a folder): the stages' parameters at the end."""
    storage = tmp_path / "local-storage"
    region = workflow.regions[0]
    write_training_data(result, DirectoryChannel(storage), region.name)
    argv = [str(build), "--storage", str(storage), "--out", str(tmp_path / "local"), "--model", str(MLP)]
    assert run_main([*argv, "-q", "--run-id", "local", "--keep-storage"]) == 0
    namespace = protocol.namespace("local", region.name)
    return trained_state(DirectoryChannel(storage), namespace, len(region.functions), ITERATIONS)


@pytest.mark.parametrize(
    "functions", [pytest.param("processes", marks=pytest.mark.slow), "in-process"], ids=["processes", "in-process"]
)
def test_the_state_machine_trains_what_cloudless_run_trains_and_trains_again(
    two_stages, functions: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`processes`: each Task a cold process running the package's handler.py (about 2 minutes here);
    `in-process`: the handlers loaded once and run in the Map's threads (warm functions)."""
    build, workflow, result = two_stages
    region = workflow.regions[0]
    storage = tmp_path / "bucket"
    channel = DirectoryChannel(storage)
    write_training_data(result, channel, region.name)
    invoke: Any
    if functions == "processes":
        expected = local_state(build, workflow, result, tmp_path)
        invoke = ProcessLambda(
            {arn(f.name, region.name): build / f.package for f in region.functions},
            {STORAGE_ENV: str(storage)},
            tmp_path / "logs",
        )
    else:
        torch.set_num_threads(1)
        expected = reference_training(result, workflow, region.name)
        monkeypatch.setenv(STORAGE_ENV, str(storage))
        invoke = InProcessLambda(
            {
                arn(f.name, region.name): load_handler(build / f.package, f"sfn_{f.name.replace('-', '_')}")
                for f in region.functions
            }
        )
    machine = definition(workflow, region.name)
    limit = float(min(f.timeout_s for f in region.functions) - 30)
    for number, given in enumerate([{"run": "first"}, {}]):  # the second: no input at all
        execution = Execution(machine, given, invoke, name=f"execution-{number}")
        output = execution.run()
        run = given.get("run", execution.name)  # by default the execution's name
        assert output == {
            "iteration": ITERATIONS,
            "stop": ITERATIONS,
            "run": run,
            "attempt": 0,
            "time_limit_s": limit,
            "plan": {},
        }
        workers_ = [(f.name, r) for f in region.functions for r in range(f.replicas)]
        assert len(execution.calls) == len(workers_) * ITERATIONS
        for call in execution.calls:
            payload = call.payload
            assert set(payload) == {"start", "stop", "replica", "run", "attempt", "time_limit_s", "plan"}
            assert (payload["run"], payload["attempt"], payload["time_limit_s"]) == (run, 0, limit)
            # Each trained: none took the other run's markers for its own (a duplicate trains nothing).
            assert call.result["status"] == "done" and not call.result["duplicate"], call.result
            assert call.result["stop"] == payload["stop"] == payload["start"] + 1
        state = trained_state(channel, protocol.namespace(run, region.name), len(region.functions), ITERATIONS)
        assert set(state) == set(expected)
        for name, value in expected.items():
            if functions == "processes":  # the same processes as cloudless-run's: the same bytes
                assert torch.equal(state[name], value), f"{run}: {name} differs from cloudless-run's"
            else:
                torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6)


# --- the state machine's semantics, on stub functions -------------------------------------------------


class Barrier:
    """A stub Lambda: each call of an iteration waits until every worker of that iteration has been
    called (so the test fails unless the Map runs them all at once), then returns a result."""

    def __init__(
        self,
        workers: int,
        fail: dict[tuple[str, int, int], list[str]] | None = None,
        timeout: float = 10.0,
        reply: dict[int, dict[str, Any]] | None = None,
    ) -> None:
        """`reply`: per range start, what every worker of that range answers instead of having run it."""
        self.workers, self.fail, self.timeout, self.reply = workers, fail or {}, timeout, reply or {}
        self.arrived: dict[int, int] = {}
        self.condition = threading.Condition()
        self.payloads: list[dict[str, Any]] = []

    def __call__(self, function: str, payload: dict[str, Any]) -> dict[str, Any]:
        errors = self.fail.get((function, payload["start"], payload["replica"]))
        if errors:
            raise FunctionError(errors.pop(0), "injected")
        with self.condition:
            self.payloads.append(payload)
            iteration = payload["start"]
            self.arrived[iteration] = self.arrived.get(iteration, 0) + 1
            self.condition.notify_all()
            if not self.condition.wait_for(lambda: self.arrived[iteration] >= self.workers, timeout=self.timeout):
                raise FunctionError("Barrier", f"iteration {iteration}: {self.arrived[iteration]} workers at once")
        reply = {"status": "done", "stop": payload["stop"], "reason": ""} | self.reply.get(iteration, {})
        return {"function": function, "replica": payload["replica"], "start": iteration, **reply}


@pytest.mark.parametrize("replicas", [(1, 2, 4), (1, 2, 38)], ids=["inline-map", "distributed-map"])
def test_every_worker_of_an_iteration_runs_at_once_with_the_run_attempt_and_time_limit(
    replicas: tuple[int, int, int],
) -> None:
    workflow = make_workflow(replicas)
    region_workers = workers(workflow, EAST)
    stub = Barrier(len(region_workers))
    given = {"run": "r1", "attempt": 2, "time_limit_s": 12.5, "start": 5, "stop": 7}
    execution = Execution(definition(workflow, EAST), given, stub, name="e1")
    assert execution.run() == {"iteration": 7, "stop": 7, "run": "r1", "attempt": 2, "time_limit_s": 12.5, "plan": {}}
    expected = sorted((arn(w.function, EAST), i, w.replica) for w in region_workers for i in (5, 6))
    assert sorted((c.function, c.payload["start"], c.payload["replica"]) for c in execution.calls) == expected
    carried = {(c.payload["run"], c.payload["attempt"], c.payload["time_limit_s"]) for c in execution.calls}
    assert carried == {("r1", 2, 12.5)}
    distributed = len(region_workers) > 40
    assert execution.child_executions == (2 * len(region_workers) if distributed else 0)


def test_the_defaults_of_the_input_and_several_regions_own_iteration_counts() -> None:
    workflow = make_workflow()
    # Several regions, each with its own planned iterations (their rounds meet).
    regions = tuple(dataclasses.replace(r, iterations={EAST: 6, WEST: 4}[r.name]) for r in workflow.regions)
    workflow = dataclasses.replace(workflow, regions=regions)
    for region, stop in ((EAST, 6), (WEST, 4)):
        stub = Barrier(len(workers(workflow, region)))
        execution = Execution(definition(workflow, region), {}, stub, name=f"default-{region}")
        limit = float(min(f.timeout_s for f in workflow.region(region).functions) - 30)
        assert execution.run() == {
            "iteration": stop,
            "stop": stop,
            "run": f"default-{region}",
            "attempt": 0,
            "time_limit_s": limit,
            "plan": {},
        }
        assert sorted({p["start"] for p in stub.payloads}) == list(range(stop))
        # Several regions: each invocation says how many iterations its region trains.
        assert {p["iterations"] for p in stub.payloads} == {stop}


def test_the_drivers_typed_input_is_what_the_state_machine_reads_and_returns() -> None:
    """The driver's ExecutionInput, every field given, runs as given: each payload carries the carried
    fields (the coordinator's plan of the region among them), a round invokes the workers given (fewer
    replicas where capacity shrank), `max_rounds` ends the execution after its rounds, and the output
    continued by ExecutionInput.continued is the next execution's input."""
    workflow = make_workflow((1, 2, 2))
    limit = float(min(f.timeout_s for f in workflow.region(EAST).functions) - 30)
    plan = {"iterations": 9, "rounds": 3, "since": 1, "first_round": 1, "replicas": [1, 1, 1], "weight": 0.5}
    given = tuple(
        {"function": arn(w.function, EAST), "stage": w.stage, "replica": w.replica}
        for w in workers(workflow, EAST)
        if w.replica == 0
    )
    sent = ExecutionInput(
        start=1, stop=5, attempt=2, time_limit_s=limit / 2, run="typed", plan=plan, workers=given, max_rounds=1
    )
    assert set(EXECUTION_FIELDS) == set(sent.to_json()) and set(CARRIED_FIELDS) < set(EXECUTION_FIELDS)
    stub = Barrier(len(given))
    execution = Execution(definition(workflow, EAST), sent.to_json(), stub, name="unused")
    output = execution.run()
    # One round of the given workers (the machine's span here: 1 iteration), then the execution ends.
    assert output == {"iteration": 2, "stop": 5, "run": "typed", "attempt": 2, "time_limit_s": limit / 2, "plan": plan}
    called = sorted((c.function, c.payload["replica"]) for c in execution.calls)
    assert called == sorted((w["function"], 0) for w in given)
    assert {tuple(str(p[name]) for name in CARRIED_FIELDS) for p in stub.payloads} == {
        ("typed", "2", str(limit / 2), str(plan))
    }
    # The handler reads the plan's fields as the payload's own.
    invocation = Invocation.from_json(stub.payloads[0])
    assert (invocation.iterations, invocation.rounds, invocation.since, invocation.replicas) == (9, 3, 1, (1, 1, 1))
    assert sent.continued(output) == dataclasses.replace(sent, start=2)
    # Without the coordinator's fields the machine runs every deployed worker until `stop`.
    plain = ExecutionInput(start=1, stop=3, attempt=0, time_limit_s=limit, run="plain")
    assert set(plain.to_json()) == {"start", "stop", "attempt", "time_limit_s", "run"}


def test_transient_lambda_errors_are_retried_and_a_function_error_fails_the_execution() -> None:
    workflow = make_workflow((1, 1, 1))
    first = workflow.region(EAST).functions[0].name
    # A throttled invoke twice, then it runs: the execution succeeds, and the retried call ran once.
    stub = Barrier(3, {(arn(first, EAST), 0, 0): ["Lambda.TooManyRequestsException", "Lambda.ServiceException"]})
    execution = Execution(definition(workflow, EAST), {"run": "r", "stop": 1}, stub, time_scale=0.0)
    assert execution.run()["iteration"] == 1
    assert [c.error for c in execution.calls if c.function == arn(first, EAST)] == [
        "Lambda.TooManyRequestsException",
        "Lambda.ServiceException",
        None,
    ]
    assert "Lambda.TooManyRequestsException" in LAMBDA_RETRY_ERRORS
    # The function raises: no retry, the Catch sends it to the Fail state, the execution fails with it.
    stub = Barrier(3, {(arn(first, EAST), 0, 0): ["ValueError"]}, timeout=0.5)
    execution = Execution(definition(workflow, EAST), {"run": "r", "stop": 1}, stub, time_scale=0.0)
    with pytest.raises(ExecutionFailed) as failed:
        execution.run()
    assert (failed.value.error, failed.value.cause) == ("ValueError", "injected")
    assert execution.status == "FAILED"
    assert [c.error for c in execution.calls if c.function == arn(first, EAST)] == ["ValueError"]


def test_an_invocation_runs_a_range_of_iterations_and_continues_where_the_time_limit_cut_it() -> None:
    """With a predicted iteration time, one round invokes every worker for a range of iterations (fewer
    requests, transitions and checkpoints than one per iteration); workers that stop early (their time
    limit) are continued from where they stopped, so no iteration is skipped."""
    workflow = make_workflow((1, 1, 1))
    workflow = dataclasses.replace(workflow, run=dataclasses.replace(workflow.run, checkpoint_every=4))
    limit = float(min(f.timeout_s for f in workflow.region(EAST).functions) - 30)
    machine = definition(workflow, EAST, iteration_s=limit / 40)  # a quarter of the limit: 10, capped at 4
    stub = Barrier(3, reply={4: {"stop": 6}})  # the range 4..8 stops at 6 (time limit)
    execution = Execution(machine, {"run": "r", "stop": 11}, stub, name="ranges")
    assert execution.run()["iteration"] == 11
    ranges = sorted({(p["start"], p["stop"]) for p in stub.payloads})
    assert ranges == [(0, 4), (4, 8), (6, 10), (10, 11)]
    assert len(stub.payloads) == 3 * len(ranges)


@pytest.mark.parametrize(
    ("status", "reason"),
    [("diverged", "loss is nan at iteration 1"), ("failed", "storage refused a write (k): OSError: disk full")],
)
def test_a_worker_that_stopped_the_run_fails_the_execution_with_its_reason(status: str, reason: str) -> None:
    workflow = make_workflow((1, 1, 1))
    stub = Barrier(3, reply={1: {"status": status, "stop": 1, "reason": reason}})
    execution = Execution(definition(workflow, EAST), {"run": "r", "stop": 3}, stub, name="diverges")
    with pytest.raises(ExecutionFailed) as failed:
        execution.run()
    assert (failed.value.error, failed.value.cause) == (RUN_STOPPED_ERROR, reason)
    assert {p["start"] for p in stub.payloads} == {0, 1}
