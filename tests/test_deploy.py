"""The deploy-and-train driver, offline: `cloudless-run BUILD --invoker lambda --stack NAME` against moto's
server (a real HTTP endpoint for CloudFormation, S3 and Step Functions). The stack is created in moto with
the generated template's Outputs (bucket, state machine, functions); moto records the executions the
driver starts, and since moto cannot run the functions' code, the rehearsal's executor
(cloudless.runtimes.rehearsal.stepfunctions_local) runs each execution with the ASL interpreter
(cloudless.runtimes.rehearsal.asl), the generated Lambda handlers in this process, storage the
stack's bucket on moto, and reports its status and output back to moto, where the driver reads them.

The driver stages the data into the bucket, starts the executions with the run's name, attempt and time
limit, continues where an execution stopped (a chunk of iterations each), starts a failed one again with
the next attempt, and fetches the model: the parameters plain PyTorch trains, and a
second run in the same bucket trains again."""

from __future__ import annotations

import json
import shlex
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import load_file

from cloudless.codegen.platforms import lambda_function_name, logical_id, render_region
from cloudless.ir.protocol import S3_ENDPOINT_ENV, STORAGE_ENV
from cloudless.runtimes.cli import main as run_main
from cloudless.runtimes.clouds import deploy
from cloudless.runtimes.rehearsal.asl import Execution, ExecutionFailed, FunctionError, substitute
from cloudless.runtimes.rehearsal.openfaas_gateway import load_handler
from cloudless.runtimes.rehearsal.stepfunctions_local import StepFunctionsExecutor
from tests.asl import InProcessLambda, ProcessLambda
from tests.conftest import TWO_STAGE_ITERATIONS
from tests.runtime_cases import MLP, reference_training
from tests.test_platforms import lambda_role

ITERATIONS = TWO_STAGE_ITERATIONS  # the two_stages build's (tests/conftest.py)
ACCOUNT = "123456789012"
AWS_REGION = "us-east-1"
STACK = "mlp-digits-trial"


@pytest.fixture(scope="module")
def expected_model(two_stages) -> dict[str, torch.Tensor]:
    """Plain PyTorch on the same samples in the same order (tests/test_invokers.py and
    tests/test_stepfunctions.py check that the same handlers train exactly what `cloudless-run` does)."""
    _, workflow, result = two_stages
    return reference_training(result, workflow, workflow.regions[0].name)


class StepFunctionsService(StepFunctionsExecutor):
    """The product's executor of moto's executions (cloudless.runtimes.rehearsal.stepfunctions_local) over this test's
    region, with faults: the first `fail_first` executions fail at once (a worker's error, say), or those
    `fail_from` on, and `on_failure` is called with the execution's input as one fails (what its worker
    wrote)."""

    def __init__(self, invoke: Any, fail_first: int = 0, on_failure: Any = None, fail_from: int | None = None) -> None:
        super().__init__([(ACCOUNT, AWS_REGION)], invoke)
        self.fail_first, self.on_failure, self.fail_from = fail_first, on_failure, fail_from
        self.started = 0

    def execute(self, record: Any, execution: Execution) -> Any:
        number, self.started = self.started, self.started + 1
        if self.fail_first > 0 or (self.fail_from is not None and number >= self.fail_from):
            self.fail_first -= 1
            if self.on_failure is not None:
                self.on_failure(execution.input)
            raise ExecutionFailed("States.TaskFailed", "injected")
        return super().execute(record, execution)


def deployed_workers(workflow: Any) -> list[dict[str, Any]]:
    """What a round invokes: every replica of every function, by the ARN the state machine has."""
    region = workflow.regions[0]
    return [
        {
            "function": f"arn:aws:lambda:{AWS_REGION}:{ACCOUNT}:function:{lambda_function_name(f.name, region.name)}",
            "stage": f.stage,
            "replica": replica,
        }
        for f in region.functions
        for replica in range(f.replicas)
    ]


@pytest.fixture
def stack(
    two_stages, moto_endpoint: str, aws_env: None, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[dict[str, str], dict[str, Any], Any]]:
    """A stack named STACK in moto: the run's bucket, the region's state machine and the functions,
    with the generated template's Outputs. Yields (outputs, the machine's definition, invoke)."""
    import boto3

    build, workflow, _ = two_stages
    region = workflow.regions[0]
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_endpoint)  # every boto3 client of the driver: moto
    monkeypatch.setenv(S3_ENDPOINT_ENV, moto_endpoint)  # the functions' storage channel
    monkeypatch.setattr(deploy, "POLL_S", 0.05)
    files = render_region(workflow, region.name, {"sam"})
    template = yaml.safe_load(files[f"regions/{region.name}/template.yaml"])
    names = {f.name: lambda_function_name(f.name, region.name) for f in region.functions}
    arns = {f"{logical_id(f)}Arn": f"arn:aws:lambda:{AWS_REGION}:{ACCOUNT}:function:{n}" for f, n in names.items()}
    text = files[f"regions/{region.name}/statemachine.asl.json"]
    definition = substitute(text, arns)
    role = lambda_role()
    resources: dict[str, Any] = {
        "RunBucket": {"Type": "AWS::S3::Bucket"},
        "IterationStateMachine": {
            "Type": "AWS::StepFunctions::StateMachine",
            "Properties": {
                "StateMachineName": f"{STACK}-machine",
                "DefinitionString": json.dumps(definition),
                "RoleArn": role,
            },
        },
    }
    for function, name in names.items():
        resources[logical_id(function)] = {
            "Type": "AWS::Lambda::Function",
            "Properties": {
                "FunctionName": name,
                # as the template's (the pre-flight reads them)
                "MemorySize": region.function(function).memory_mb,
                "Timeout": region.function(function).timeout_s,
                "Role": role,
                "Runtime": "python3.12",
                "Handler": "handler.handler",
                "Code": {"ZipFile": "def handler(event, context):\n    return event\n"},
            },
        }
    body = {"AWSTemplateFormatVersion": "2010-09-09", "Resources": resources, "Outputs": template["Outputs"]}
    cloudformation = boto3.client("cloudformation", region_name=AWS_REGION)
    cloudformation.create_stack(StackName=STACK, TemplateBody=json.dumps(body))
    outputs = {
        o["OutputKey"]: o["OutputValue"]
        for o in cloudformation.describe_stacks(StackName=STACK)["Stacks"][0]["Outputs"]
    }
    monkeypatch.setenv(STORAGE_ENV, f"s3://{outputs['BucketName']}/{workflow.storage.prefix}")
    handlers = {
        arns[f"{logical_id(f.name)}Arn"]: load_handler(build / f.package, f"deploy_{f.name.replace('-', '_')}")
        for f in region.functions
    }
    try:
        yield outputs, definition, InProcessLambda(handlers)
    finally:
        cloudformation.delete_stack(StackName=STACK)


@pytest.mark.slow
@pytest.mark.parametrize("functions", ["in-process", "processes"])
def test_the_driver_trains_on_the_stack_and_a_second_run_trains_again(
    two_stages, expected_model, stack, functions: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`in-process`: the handlers run in the service's threads; `processes`: each invocation a cold process
    running the package's handler.py, its storage the stack's bucket on moto over HTTP (about 2 minutes)."""
    import boto3

    build, workflow, _ = two_stages
    torch.set_num_threads(1)
    outputs, definition, invoke = stack
    if functions == "processes":
        region = workflow.regions[0]
        packages = {
            f"arn:aws:lambda:{AWS_REGION}:{ACCOUNT}:function:{lambda_function_name(f.name, region.name)}": build
            / f.package
            for f in region.functions
        }
        invoke = ProcessLambda(packages, {}, tmp_path / "logs")  # the environment: the deployment's (the fixture's)
    with StepFunctionsService(invoke) as service:
        for run_id in ("first", "second"):
            out = tmp_path / run_id
            argv = [str(build), "--invoker", "lambda", "--stack", STACK, "--run-id", run_id, "--out", str(out)]
            code = run_main([*argv, "--model", str(MLP)])
            captured = capsys.readouterr()
            assert code == 0, captured.err
            assert f"iteration      {ITERATIONS}/{ITERATIONS}" in captured.out
            model = load_file(out / "model.safetensors")
            assert set(model) == set(expected_model)
            for name, value in expected_model.items():
                torch.testing.assert_close(model[name], value, rtol=1e-5, atol=1e-6)
            metrics = json.loads((out / "metrics.json").read_text())
            region = metrics["regions"][workflow.regions[0].name]
            assert metrics["status"] == "done" and region["bucket"] == outputs["BucketName"]
            assert (metrics["invoker"], metrics["run_id"], "error" in metrics) == ("lambda", run_id, False)
            # One execution per round of the machine (1 iteration here: no predicted iteration time), each
            # from where the last stopped, with the run's plan and every deployed worker.
            inputs = [e["input"] for e in region["executions"]]
            assert [(i["start"], i["stop"], i["attempt"], i["max_rounds"]) for i in inputs] == [
                (start, ITERATIONS, 0, 1) for start in range(ITERATIONS)
            ]
            assert {(i["run"], i["time_limit_s"], i["plan"]["iterations"]) for i in inputs} == {
                (run_id, 870.0, ITERATIONS)
            }
            assert all(i["workers"] == deployed_workers(workflow) for i in inputs)
            assert [p["iteration"] for p in region["progress"]] == list(range(ITERATIONS))
        # Every invocation carried its run's name, attempt and time limit, and trained (no duplicate).
        calls = [c for e in service.ran for c in e.calls]
        assert len(calls) == 2 * ITERATIONS * 3
        assert {c.payload["run"] for c in calls} == {"first", "second"}
        assert all(c.result["status"] == "done" and not c.result["duplicate"] for c in calls)
    # The data stays in the bucket; each run's keys are gone.
    s3 = boto3.client("s3", region_name=AWS_REGION)
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=outputs["BucketName"]).get("Contents", [])]
    assert keys and all("/data/" in k or k.split("/")[1] == "data" for k in keys), keys[:5]


@pytest.mark.slow
def test_a_failed_execution_is_started_again_with_the_next_attempt(
    two_stages, expected_model, stack, tmp_path: Path
) -> None:
    build, workflow, _ = two_stages
    torch.set_num_threads(1)
    outputs, definition, invoke = stack
    with StepFunctionsService(invoke, fail_first=1):
        out = tmp_path / "out"
        argv = [str(build), "--invoker", "lambda", "--stack", STACK, "--run-id", "again", "--out", str(out), "-q"]
        assert run_main([*argv, "--model", str(MLP), "--retries", "1"]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    executions = metrics["regions"][workflow.regions[0].name]["executions"]
    assert [(e["input"]["attempt"], e["input"]["start"], e["status"]) for e in executions] == [
        (0, 0, "FAILED"),
        (1, 0, "SUCCEEDED"),
        (1, 1, "SUCCEEDED"),
        (1, 2, "SUCCEEDED"),
    ]
    model = load_file(out / "model.safetensors")
    for name, value in expected_model.items():
        torch.testing.assert_close(model[name], value, rtol=1e-5, atol=1e-6)


def test_a_run_that_failed_on_the_stack_resumes_with_the_command_it_printed(
    two_stages, expected_model, stack, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Out of retries after its first execution, the run's last line names its cause and the command that
    continues it; that command, run as printed, resumes from the checkpoint in the bucket with executions of
    new names and trains what an undisturbed run trains."""
    build, workflow, _ = two_stages
    torch.set_num_threads(1)
    outputs, definition, invoke = stack
    out = tmp_path / "out"
    with StepFunctionsService(invoke, fail_from=1):
        argv = [str(build), "--invoker", "lambda", "--stack", STACK, "--run-id", "cut", "--out", str(out), "-q"]
        assert run_main([*argv, "--model", str(MLP), "--retries", "0"]) == 1
    err = capsys.readouterr().err
    cause, _, hint = err.strip().partition("; to continue it: ")
    assert cause.startswith("cloudless-run: the run failed: ") and "injected" in cause, err
    command = shlex.split(hint)
    assert command == [
        *("cloudless-run", str(build), "--resume", "cut", "--out", str(out), "--model", str(MLP)),
        *("--invoker", "lambda", "--stack", STACK),
    ]
    with StepFunctionsService(invoke):
        assert run_main(command[1:]) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert f"resuming run cut: {workflow.regions[0].name} from iteration 1" in printed, printed
    metrics = json.loads((out / "metrics.json").read_text())
    executions = metrics["regions"][workflow.regions[0].name]["executions"]
    assert [e["input"]["start"] for e in executions] == list(range(1, ITERATIONS))
    assert all(e["name"].startswith("cut-resumed") and e["status"] == "SUCCEEDED" for e in executions)
    model = load_file(out / "model.safetensors")
    for name, value in expected_model.items():
        torch.testing.assert_close(model[name], value, rtol=1e-5, atol=1e-6)
    # A Lambda rehearsal deploys new stacks: nothing of an earlier one to resume.
    assert run_main([str(build), "--invoker", "lambda", "--rehearse", "--resume", "cut", "--out", str(out)]) == 2
    assert "--resume: not with --invoker lambda --rehearse" in capsys.readouterr().err


@pytest.mark.slow
def test_the_drivers_credentials_refused_for_seconds_are_ridden_out(
    two_stages, expected_model, stack, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """As while a rotated access key propagates: once the run has begun (the driver's first look at an
    execution), AWS refuses 3 s of the driver's requests to Step Functions (UnrecognizedClientException) and
    then 3 s of those to S3 (InvalidAccessKeyId). The driver rides them out; the functions, processes with
    their role's credentials, are not refused; the run trains what plain PyTorch trains."""
    import boto3
    from botocore.awsrequest import AWSResponse

    build, workflow, _ = two_stages
    region = workflow.regions[0]
    packages = {
        f"arn:aws:lambda:{AWS_REGION}:{ACCOUNT}:function:{lambda_function_name(f.name, region.name)}": build / f.package
        for f in region.functions
    }
    invoke = ProcessLambda(packages, {}, tmp_path / "logs")
    refused: dict[str, int] = {"sfn": 0, "s3": 0}
    began: dict[str, float] = {}  # when each service's refusals began
    codes = {"sfn": "UnrecognizedClientException", "s3": "InvalidAccessKeyId"}

    def refuse(model: Any, **_: Any) -> Any:
        service = model.service_model.service_id.hyphenize()
        if service == "sfn" and model.name == "DescribeExecution":
            began.setdefault("sfn", time.monotonic())
        if service == "s3" and "sfn" in began and time.monotonic() - began["sfn"] > 3:
            began.setdefault("s3", time.monotonic())
        if service not in began or time.monotonic() - began[service] > 3:
            return None
        refused[service] += 1
        message = "The security token included in the request is invalid."
        return AWSResponse("", 403, {}, None), {"Error": {"Code": codes[service], "Message": message}}

    boto3.setup_default_session()  # the driver's clients are made from it, and copy its handlers
    for service in refused:
        boto3.DEFAULT_SESSION.events.register(f"before-call.{service}", refuse)
    try:
        with StepFunctionsService(invoke):
            out = tmp_path / "out"
            argv = [str(build), "--invoker", "lambda", "--stack", STACK, "--run-id", "rotated", "--out", str(out)]
            assert run_main([*argv, "--model", str(MLP), "-q", "--retries", "0"]) == 0, capsys.readouterr().err
    finally:
        boto3.DEFAULT_SESSION = None
    assert refused["sfn"] >= 3 and refused["s3"] >= 3, refused
    model = load_file(out / "model.safetensors")
    for name, value in expected_model.items():
        torch.testing.assert_close(model[name], value, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_an_execution_that_made_no_progress_is_followed_by_a_new_attempt(
    two_stages, expected_model, stack, tmp_path: Path
) -> None:
    """Attempt 0's claims are held by invocations that died without a result: every worker answers as their
    duplicate (stop = start), the execution ends where it began. The driver starts attempt 1, which
    trains what plain PyTorch trains."""
    build, workflow, _ = two_stages
    torch.set_num_threads(1)
    outputs, definition, invoke = stack

    def claims_held(function: str, payload: Any) -> Any:
        if payload["attempt"] == 0:
            return {"status": "duplicate", "stop": payload["start"], "reason": ""}
        return invoke(function, payload)

    with StepFunctionsService(claims_held):
        out = tmp_path / "out"
        argv = [str(build), "--invoker", "lambda", "--stack", STACK, "--run-id", "held", "--out", str(out), "-q"]
        assert run_main([*argv, "--model", str(MLP), "--retries", "1"]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    executions = metrics["regions"][workflow.regions[0].name]["executions"]
    assert [(e["input"]["attempt"], e["input"]["start"]) for e in executions][:2] == [(0, 0), (1, 0)]
    model = load_file(out / "model.safetensors")
    for name, value in expected_model.items():
        torch.testing.assert_close(model[name], value, rtol=1e-5, atol=1e-6)


def test_an_execution_whose_worker_recorded_an_abort_is_not_retried(two_stages, stack, tmp_path: Path) -> None:
    """A function whose model code raised records why (the abort record) and fails its invocation, which
    fails the execution with the function's error: the driver reads the record and stops, no retry."""
    from cloudless.ir import protocol
    from cloudless.runtimes.storage.channels import open_channel

    build, workflow, _ = two_stages
    outputs, definition, invoke = stack
    region = workflow.regions[0].name
    channel = open_channel(f"s3://{outputs['BucketName']}/{workflow.storage.prefix}")
    why = "iteration 0: the forward of stage 1 raised ValueError: boom"

    def model_failed(document: dict[str, Any]) -> None:
        record = protocol.AbortRecord("failed", why, 0, 1, workflow.regions[0].functions[1].name)
        channel.claim(protocol.abort_key(protocol.namespace(document["run"], region)), record.encode())

    with StepFunctionsService(invoke, 1, model_failed):
        out = tmp_path / "out"
        argv = [str(build), "--invoker", "lambda", "--stack", STACK, "--run-id", "raises", "--out", str(out), "-q"]
        assert run_main([*argv, "--model", str(MLP), "--retries", "3"]) == 1
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["error"] == f"{region}: {why}"
    assert [e["status"] for e in metrics["regions"][region]["executions"]] == ["FAILED"]


def test_ctrl_c_stops_the_running_execution(two_stages, stack, tmp_path: Path, capsys) -> None:
    """Interrupted, the driver stops the execution it started (StopExecution) instead of leaving it to run
    and bill, and says so."""
    import signal

    from moto.stepfunctions.models import stepfunctions_backends

    build, _, _ = two_stages
    outputs, definition, invoke = stack
    backend = stepfunctions_backends[ACCOUNT][AWS_REGION]

    def busy(function: str, payload: Any) -> Any:  # a worker still at work when Ctrl-C comes
        interrupt.set()
        # It answers only once the run is over, and never runs the real handler: that would read the
        # storage from the environment of whatever test runs next in this process.
        released.wait(60)
        return {"status": "duplicate", "stop": payload["start"], "reason": ""}

    interrupt, released = threading.Event(), threading.Event()
    threading.Thread(target=lambda: interrupt.wait(60) and signal.raise_signal(signal.SIGINT), daemon=True).start()
    try:
        with StepFunctionsService(busy):
            argv = [str(build), "--invoker", "lambda", "--stack", STACK, "--run-id", "stopped", "--out", str(tmp_path)]
            assert run_main([*argv, "--model", str(MLP), "-q"]) == 130
    finally:
        released.set()
    (execution,) = backend.describe_state_machine(outputs["IterationStateMachineArn"]).executions
    assert execution.status == "ABORTED"
    err = capsys.readouterr().err
    assert "cloudless-run: stopped 1 running execution(s) of the run" in err


def test_a_stack_that_is_not_there_or_not_the_runs(two_stages, stack, tmp_path: Path, capsys) -> None:
    build, _, _ = two_stages
    out = tmp_path / "out"
    assert run_main([str(build), "--invoker", "lambda", "--stack", "absent", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("cloudless-run: --stack absent: ") and "does not exist" in err and err.count("\n") == 1
    assert run_main([str(build), "--stack", STACK, "--out", str(out)]) == 2
    assert "--stack: only with --invoker lambda, not local" in capsys.readouterr().err


def test_a_function_error_ends_the_run_with_its_message_on_one_line(two_stages, stack, tmp_path: Path, capsys) -> None:
    """A function's exception fails the execution with Lambda's error document as its cause (stack trace
    included): the run ends with the error's type and message, one line."""
    build, workflow, _ = two_stages
    _, _, _ = stack
    document = {"errorMessage": "'boom'", "errorType": "KeyError", "stackTrace": ['  File "x.py", line 1\n    y\n']}

    def failing(function: str, payload: Any) -> Any:
        raise FunctionError("KeyError", json.dumps(document))

    with StepFunctionsService(failing):
        argv = [str(build), "--invoker", "lambda", "--stack", STACK, "--run-id", "boom", "--out", str(tmp_path), "-q"]
        assert run_main([*argv, "--model", str(MLP), "--retries", "0"]) == 1
    region = workflow.regions[0].name
    expected = f"cloudless-run: the run failed: {region}: execution boom-0 failed: KeyError: 'boom' (attempt 1 of 1)"
    resume = f"cloudless-run {build} --resume boom --out {tmp_path} --model {MLP} --invoker lambda --stack {STACK}"
    assert capsys.readouterr().err == f"{expected}; to continue it: {resume}\n"
