"""`cloudless-run BUILD --invoker lambda --rehearse`: the SAM templates deployed into a local AWS endpoint
(moto's server, the SAM transform, CreateStack), the state machines run by the ASL interpreter, each
Lambda invocation a local process entered through the real runtime interface client (awslambdaric),
and the real driver (`--stack`) training on it."""

from __future__ import annotations

import json
import re
import shutil
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from cloudless.runtimes.cli import main as run_main
from cloudless.runtimes.rehearsal.asl import Execution, ExecutionFailed, FunctionError
from cloudless.runtimes.rehearsal.lambda_local import FunctionImage, LambdaService
from tests.conftest import TWO_STAGE_ITERATIONS
from tests.runtime_cases import MLP, reference_training

ARN = "arn:aws:lambda:us-east-1:123456789012:function:"

#: a function package of the tests' own: it sleeps past its timeout on its first invocation (a marker file
#: says which invocation is the first), raises when asked, and answers with its process id (and as a worker)
SLEEPER = """
import os, time
from pathlib import Path

def handler(event, context):
    marker = Path(event["marker"])
    if not marker.exists():
        marker.write_text("timed out once")
        time.sleep(600)
    if event.get("raise"):
        raise KeyError(event["raise"])
    # what the generated machine selects from a worker's answer (status, stop, reason)
    return {"pid": os.getpid(), "left_ms": context.get_remaining_time_in_millis(), "status": "done",
            "stop": event.get("stop"), "reason": ""}
"""


@pytest.fixture
def sleeper(tmp_path: Path) -> LambdaService:
    package = tmp_path / "package"
    package.mkdir()
    (package / "app.py").write_text(SLEEPER)
    # 3 s: an answer that takes none must not time out on a loaded machine (the one that sleeps still does)
    configuration = {"FunctionArn": f"{ARN}sleeper", "Timeout": 3, "MemorySize": 256, "RevisionId": "1"}
    service = LambdaService(
        {"sleeper": FunctionImage(package, "app.handler")}, lambda name: configuration, tmp_path / "logs"
    )
    yield service
    service.close()


@pytest.fixture(scope="module")
def sam_build(two_stages, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The two_stages build with its SAM files, as a compile for AWS writes them (template.yaml and
    statemachine.asl.json per region, samconfig.toml), and its manifest."""
    from cloudless.codegen.platforms import render_region, render_samconfig
    from cloudless.compiler.build import write_build
    from cloudless.ir.files import BUILD_MARKER, build_manifest

    build, workflow, _ = two_stages
    files = {str(p.relative_to(build)): p.read_bytes() for p in build.rglob("*") if p.is_file()}
    files.pop(BUILD_MARKER)
    for region in workflow.regions:
        rendered = render_region(workflow, region.name, {"sam"}, packages=files)
        files.update({path: text.encode() for path, text in rendered.items()})
    files["samconfig.toml"] = render_samconfig(workflow).encode()
    output = tmp_path_factory.mktemp("sam_build") / "build"
    write_build({**files, BUILD_MARKER: build_manifest(files)}, output)
    return output


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "State:\tZ" not in status


def test_a_lambda_timeout_is_lambdas_error_and_the_state_machines_retry_runs_it_again(
    sleeper: LambdaService, tmp_path: Path
) -> None:
    """The first invocation sleeps past the function's 3 s timeout: its environment is killed, and the task
    fails as on Lambda (Sandbox.Timedout, "Task timed out after 3.00 seconds"), which the Retry on that
    error takes; the retry runs in a new environment (a cold start) and succeeds."""
    definition = {
        "StartAt": "Invoke",
        "States": {
            "Invoke": {
                "Type": "Task",
                "Resource": "arn:aws:states:::lambda:invoke",
                "Parameters": {"FunctionName": f"{ARN}sleeper", "Payload": {"marker.$": "$.marker"}},
                "ResultSelector": {"pid.$": "$.Payload.pid"},
                "Retry": [{"ErrorEquals": ["Sandbox.Timedout"], "IntervalSeconds": 1, "MaxAttempts": 1}],
                "End": True,
            }
        },
    }
    execution = Execution(definition, {"marker": str(tmp_path / "marker")}, sleeper, time_scale=0.0)
    output = execution.run()
    first, second = execution.calls
    assert first.error == "Sandbox.Timedout" and second.error is None
    assert output == {"pid": second.result["pid"]}
    assert sleeper.started == 2  # the timed-out environment is not used again
    log = "\n".join(p.read_text() for p in sorted((tmp_path / "logs").iterdir()))
    assert log.count("START RequestId:") == 2 and "Duration:" in log


def test_the_generated_state_machine_catches_a_timeout_and_fails_with_lambdas_error(
    two_stages, sleeper: LambdaService, tmp_path: Path
) -> None:
    """The generated machine retries Lambda's service errors only: a timeout is caught (States.ALL) and
    fails the execution with Lambda's error name and document, as on AWS; the driver then starts the next
    attempt. The timed-out process is gone."""
    from cloudless.codegen.platforms import render_region
    from cloudless.runtimes.rehearsal.asl import substitute

    _, workflow, _ = two_stages
    region = workflow.regions[0]
    files = render_region(workflow, region.name, {"sam"})
    text = files[f"regions/{region.name}/statemachine.asl.json"]
    definition = substitute(text, {name: f"{ARN}sleeper" for name in _substitutions(text)})
    execution = Execution(definition, {"start": 0, "stop": 1, "run": "r"}, _with_marker(sleeper, tmp_path))
    with pytest.raises(ExecutionFailed) as failed:
        execution.run()
    assert failed.value.error == "Sandbox.Timedout"
    cause = json.loads(failed.value.cause)
    assert cause["errorType"] == "Sandbox.Timedout"
    assert cause["errorMessage"].startswith("RequestId: ") and cause["errorMessage"].endswith(
        "Error: Task timed out after 3.00 seconds"
    )
    # Each worker invoked once (no Retry of a timeout in the generated machine): one timed out.
    assert len(execution.calls) == sum(f.replicas for f in region.functions)
    assert [c.error for c in execution.calls].count("Sandbox.Timedout") == 1
    assert len(sleeper._idle["sleeper"]) == sleeper.started - 1  # the timed-out environment is not kept


def test_a_function_error_is_its_error_type_and_the_environment_stays_warm(
    sleeper: LambdaService, tmp_path: Path
) -> None:
    marker = tmp_path / "marker"
    marker.write_text("no timeout")
    with pytest.raises(FunctionError) as raised:
        sleeper("sleeper", {"marker": str(marker), "raise": "boom"})
    assert raised.value.error == "KeyError"
    document = json.loads(raised.value.cause)
    assert document["errorType"] == "KeyError" and document["errorMessage"] == "'boom'" and document["stackTrace"]
    answer = sleeper(f"{ARN}sleeper", {"marker": str(marker)})
    assert sleeper.started == 1 and _alive(answer["pid"])  # the same warm environment answered
    assert "State:\tT" in Path(f"/proc/{answer['pid']}/status").read_text()  # frozen until the next invocation
    assert 0 < answer["left_ms"] <= 3000  # the deadline Lambda gives the context (its timeout: 3 s)
    with pytest.raises(FunctionError) as missing:
        sleeper("absent", {})
    assert missing.value.error == "Lambda.ResourceNotFoundException"
    sleeper.close()
    assert not _alive(answer["pid"])


def _with_marker(service: LambdaService, tmp_path: Path) -> Any:
    def invoke(function: str, payload: Any) -> Any:
        return service(function, {**payload, "marker": str(tmp_path / "marker")})

    return invoke


def _substitutions(text: str) -> set[str]:
    import re

    return set(re.findall(r"\$\{(\w+)\}", text))


@pytest.mark.slow
def test_a_rehearsal_trains_what_plain_pytorch_trains(
    two_stages, sam_build: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two stages, replicas (2, 1): deployed from the generated SAM template, run through Step Functions'
    interpreter and Lambda's runtime interface client, the run ends with plain PyTorch's parameters."""
    _, workflow, result = two_stages
    build = sam_build
    expected = reference_training(result, workflow, workflow.regions[0].name)
    out = tmp_path / "out"
    code = run_main(
        [
            str(build),
            "--invoker",
            "lambda",
            "--rehearse",
            "--run-id",
            "rehearsed",
            "--out",
            str(out),
            "--model",
            str(MLP),
        ]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "created in the local AWS endpoint http://127.0.0.1:" in captured.out
    # (No per-iteration lines asserted: this build checkpoints every iteration, so its workers sweep an
    # iteration's reports two iterations later, faster than the driver's poll may read them.)
    assert f"trained {TWO_STAGE_ITERATIONS} iterations on the stack" in captured.out
    model = load_file(out / "model.safetensors")
    assert set(model) == set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(model[name], value, rtol=1e-5, atol=1e-6)
    metrics = json.loads((out / "metrics.json").read_text())
    region = metrics["regions"][workflow.regions[0].name]
    assert metrics["status"] == "done" and region["stack"] == f"{workflow.run.name}-{workflow.regions[0].name}"
    assert region["bucket"].startswith(region["stack"].lower())  # CloudFormation named the stack's bucket
    # Every invocation went through an environment's runtime interface client (its START/REPORT lines); the
    # three workers' environments stayed warm from round to round.
    invocations, environments = re.search(
        r"rehearsal: (\d+) Lambda invocation\(s\) in (\d+) execution environment\(s\)", captured.out
    ).groups()
    logs = "\n".join(p.read_text() for p in (out / "rehearsal" / "lambda").iterdir())
    assert logs.count("REPORT RequestId:") == int(invocations) >= 3 * TWO_STAGE_ITERATIONS // 3
    assert int(environments) == 3 and len(list((out / "rehearsal" / "lambda").iterdir())) == 3
    assert "Traceback" not in logs
    endpoint = captured.out.split("local AWS endpoint ")[1].split(" ")[0]
    host, port = endpoint.removeprefix("http://").split(":")
    with pytest.raises(OSError), socket.create_connection((host, int(port)), timeout=5):
        pass  # the endpoint is gone


@pytest.mark.slow
def test_a_function_whose_model_code_raises_ends_the_rehearsal_with_one_line(
    two_stages, sam_build: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Stage 1's forward raises: its function records why and fails its invocation (through the runtime
    interface client's error document); the execution fails and the driver stops on the record, no retry."""
    _, workflow, _ = two_stages
    edited = tmp_path / "build"
    shutil.copytree(sam_build, edited)
    stage = edited / workflow.regions[0].functions[1].package / "stage.py"
    stage.write_text(
        stage.read_text() + "\n\ndef _raise(self, *args):\n    raise ValueError('boom')\n\nStage.forward = _raise\n"
    )
    out = tmp_path / "out"
    argv = [str(edited), "--invoker", "lambda", "--rehearse", "--out", str(out), "--model", str(MLP), "-q"]
    assert run_main([*argv, "--no-verify-build", "--retries", "2"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("cloudless-run: the run failed: aws-us-east-1: ")
    assert "ValueError: boom" in err
    metrics = json.loads((out / "metrics.json").read_text())
    assert [e["status"] for e in metrics["regions"]["aws-us-east-1"]["executions"]] == ["FAILED"]


def test_rehearse_is_refused_with_another_invoker_or_a_stack(two_stages, tmp_path: Path, capsys) -> None:
    build, _, _ = two_stages
    assert run_main([str(build), "--rehearse", "--out", str(tmp_path / "a")]) == 2
    assert capsys.readouterr().err == "cloudless-run: --rehearse: only with --invoker openfaas or lambda, not local\n"
    argv = [str(build), "--invoker", "lambda", "--rehearse", "--stack", "x", "--out", str(tmp_path / "b")]
    assert run_main(argv) == 2
    expected = "cloudless-run: --stack: not with --rehearse (the rehearsal deploys its own stacks)\n"
    assert capsys.readouterr().err == expected
    # a build written without its SAM files (--target openfaas): named, nothing deployed
    assert run_main([str(build), "--invoker", "lambda", "--rehearse", "--out", str(tmp_path / "c"), "-q"]) == 2
    expected = f"cloudless-run: {build}/samconfig.toml: not found; the build has no SAM deployment (compile with "
    assert capsys.readouterr().err == expected + "--target sam or both)\n"


def test_a_function_over_its_memory_is_stopped_with_lambdas_out_of_memory_error(tmp_path: Path) -> None:
    """Resident memory above MemorySize: the environment is killed and the invoke fails as on Lambda."""
    package = tmp_path / "package"
    package.mkdir()
    (package / "app.py").write_text(
        "import time\n\ndef handler(event, context):\n    held = b'x' * (400 * 2**20)\n    time.sleep(600)\n"
        "    return len(held)\n"
    )
    configuration = {"FunctionArn": f"{ARN}hungry", "Timeout": 900, "MemorySize": 128, "RevisionId": "1"}
    service = LambdaService({"hungry": FunctionImage(package, "app.handler")}, lambda n: configuration, tmp_path / "l")
    try:
        with pytest.raises(FunctionError) as raised:
            service("hungry", {})
    finally:
        service.close()
    assert raised.value.error == "Runtime.OutOfMemory"
    assert json.loads(raised.value.cause)["errorMessage"].endswith("Error: Runtime exited with error: signal: killed")
    assert "Max Memory Used:" in next((tmp_path / "l").iterdir()).read_text()


def test_a_stopped_execution_ends_at_once_even_in_a_retry_wait() -> None:
    """StopExecution: the interpreter leaves a Retry's wait (an hour here) and the execution is ABORTED."""
    import threading

    from cloudless.runtimes.rehearsal.asl import ExecutionAborted

    failed = threading.Event()

    def invoke(function: str, payload: Any) -> Any:
        failed.set()
        raise FunctionError("Lambda.ServiceException", "{}")

    definition = {
        "StartAt": "Invoke",
        "States": {
            "Invoke": {
                "Type": "Task",
                "Resource": "arn:aws:states:::lambda:invoke",
                "Parameters": {"FunctionName": "f", "Payload": {}},
                "Retry": [{"ErrorEquals": ["Lambda.ServiceException"], "IntervalSeconds": 3600, "MaxAttempts": 3}],
                "End": True,
            }
        },
    }
    execution = Execution(definition, {}, invoke)
    ended: list[BaseException] = []
    thread = threading.Thread(target=lambda: _run_into(execution, ended), daemon=True)
    thread.start()
    assert failed.wait(60)
    execution.stop()
    thread.join(60)
    assert not thread.is_alive() and isinstance(ended[0], ExecutionAborted)
    assert execution.status == "ABORTED" and len(execution.calls) == 1


def _run_into(execution: Execution, ended: list[BaseException]) -> None:
    try:
        execution.run()
    except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
        ended.append(exc)


def test_a_task_result_over_step_functions_payload_limit_fails_the_state() -> None:
    definition = {
        "StartAt": "Invoke",
        "States": {
            "Invoke": {
                "Type": "Task",
                "Resource": "arn:aws:states:::lambda:invoke",
                "Parameters": {"FunctionName": "f", "Payload": {"size.$": "$.size"}},
                "End": True,
            }
        },
    }
    answer = lambda function, payload: "x" * payload["size"]  # noqa: E731
    assert Execution(definition, {"size": 200 * 1024}, answer).run()["Payload"] == "x" * 200 * 1024
    with pytest.raises(ExecutionFailed) as failed:
        Execution(definition, {"size": 300 * 1024}, answer).run()
    assert failed.value.error == "States.DataLimitExceeded"
