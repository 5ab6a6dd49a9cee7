"""`cloudless-run --invoker openfaas --rehearse` (runtimes/rehearsal/openfaas.py): a region's stack deployed on
this machine behind a CE-like gateway, each replica a process of its own (a watchdog front, the template's
request handling under waitress), then trained through the OpenFaaS invoker.

The gateway's and the watchdog's answers are asserted on real HTTP: a busy replica's 429 passed back
unretried, the watchdog's 504 past exec_timeout (the function's code running on), basic auth on /system/
only, secrets mounted per function, the stack's CPU limit as the function's share. A rehearsal of the MLP
in 2 stages ends with plain PyTorch's parameters."""

from __future__ import annotations

import json
import os
import signal
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from cloudless.compiler.frontend.model_file import load_model_file
from cloudless.ir.files import load_workflow
from cloudless.ir.protocol import STORAGE_SECRET, TOKEN_HEADER, TOKEN_SECRET
from cloudless.runtimes.cli import main as run_main
from cloudless.runtimes.rehearsal import openfaas_index
from cloudless.runtimes.rehearsal.openfaas import RehearsalError, read_stack, rehearse_region, template_index
from cloudless.runtimes.rehearsal.openfaas_gateway import LIMIT_EXCEEDED, basic_auth_header
from tests.reference import plain_training
from tests.runtime_cases import MLP

#: a function that tells who it is and what it was given, and waits for a file when asked to
PROBE = """
import json, os, pathlib, time

def handle(event, context):
    request = json.loads(event.body or b"{}")
    if "allocate_mb" in request:  # more than the container's limit, held until it is killed
        held = b"x" * (request["allocate_mb"] << 20)
        time.sleep(60)
    if "wait_for" in request:
        pathlib.Path(request["started"]).touch()
        while not pathlib.Path(request["wait_for"]).exists():
            time.sleep(0.02)
    folder = pathlib.Path(os.environ["CLOUDLESS_SECRETS_DIR"])
    answer = {
        "pid": os.getpid(),
        "hostname": context.hostname,
        "secrets": {p.name: p.read_text() for p in sorted(folder.iterdir())},
        "emulate": os.environ.get("CLOUDLESS_EMULATE"),
        "storage": os.environ.get("CLOUDLESS_STORAGE"),
        "threads": os.environ.get("OMP_NUM_THREADS"),
        "header": event.headers.get("X-Probe"),
        "index": os.environ.get("PROBE_INDEX"),
    }
    return {"statusCode": 200, "body": answer}
"""

STACK = """version: 1.0
provider: {name: openfaas, gateway: "http://127.0.0.1:8080"}
functions:
  probe:
    lang: python3-http-debian
    handler: ./functions/probe
    image: probe:latest
    environment:
      CLOUDLESS_STORAGE: "s3://deployed-bucket/run"
      exec_timeout: "%s"
      max_inflight: "1"
    secrets: [cloudless-token]
    limits: {memory: "256Mi", cpu: "250m"}
    labels: {com.openfaas.scale.min: "%s", com.openfaas.scale.max: "%s"}
"""


def region_folder(tmp_path: Path, *, exec_timeout: str = "3s", replicas: int = 1) -> Path:
    folder = tmp_path / "regions" / "here"
    (folder / "functions" / "probe").mkdir(parents=True)
    (folder / "functions" / "probe" / "handler.py").write_text(PROBE)
    (folder / "stack.yaml").write_text(STACK % (exec_timeout, replicas, replicas))
    return folder


def post(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> tuple[int, bytes, Any]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers or {}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.read(), response.headers
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), exc.headers


def wait_for(path: Path) -> None:
    """Until `path` exists (a replica says it started), however long a loaded machine takes."""
    event = threading.Event()
    while not path.exists():
        event.wait(0.02)


def test_replicas_are_processes_with_their_secrets_environment_and_cpu_share(tmp_path: Path) -> None:
    folder = region_folder(tmp_path, replicas=2)
    secrets = {TOKEN_SECRET: b"the-token\n", STORAGE_SECRET: b"AWS_ACCESS_KEY_ID=x\n", "unlisted": b"no"}
    with rehearse_region(folder, secrets, {"CLOUDLESS_STORAGE": "/the/run/storage"}, tmp_path / "logs") as deployed:
        url = f"{deployed.gateway.url}/function/probe"
        answers = []
        for _ in range(8):  # one call at a time: each goes to a replica picked at random
            status, body, headers = post(url, {}, {"X-Probe": "passed on"})
            assert status == 200, body
            assert headers["X-Call-Id"]
            answers.append(json.loads(body))
        replicas = deployed.replicas
    pids = {a["pid"] for a in answers}
    assert len(pids) == 2 and os.getpid() not in pids  # two processes, neither this one
    assert {a["hostname"] for a in answers} == {"probe-0", "probe-1"}
    for answer in answers:
        # only the secrets the stack lists, mounted as files; the stack's environment but the run's storage
        assert answer["secrets"] == {TOKEN_SECRET: "the-token\n"}
        assert answer["storage"] == "/the/run/storage"
        assert json.loads(answer["emulate"])["vcpus"] == 0.25  # limits.cpu 250m
        assert answer["threads"] is None  # the handler caps torch's threads from its share itself
        assert answer["header"] == "passed on"
    assert all(r.process.poll() is not None for r in replicas)  # stopped at the end


@pytest.mark.slow
def test_a_template_pulled_beside_the_stack_serves_the_functions(tmp_path: Path) -> None:
    """Where `faas-cli template pull` put the template's index.py (report.md's step), the replicas run that
    file, unchanged: here one that says so before doing what the template does (port 5000 as upstream's,
    which the launcher turns into a free one); else the rehearsal's own."""
    folder = region_folder(tmp_path)
    with rehearse_region(folder, {TOKEN_SECRET: b"t"}, {}, tmp_path / "logs") as deployed:
        status, body, _ = post(f"{deployed.gateway.url}/function/probe", {})
        assert status == 200 and json.loads(body)["index"] is None
        assert deployed.index == template_index(folder) and deployed.index.name == "openfaas_index.py"
    pulled = folder / "template" / "python3-http-debian" / "index.py"
    pulled.parent.mkdir(parents=True)
    ours = Path(openfaas_index.__file__).read_text()
    first = "from __future__ import annotations\n"
    pulled.write_text(ours.replace(first, first + 'import os as _os\n_os.environ["PROBE_INDEX"] = "pulled"\n', 1))
    assert "port=5000" in ours
    with rehearse_region(folder, {TOKEN_SECRET: b"t"}, {}, tmp_path / "logs") as deployed:
        status, body, _ = post(f"{deployed.gateway.url}/function/probe", {})
        assert status == 200 and json.loads(body)["index"] == "pulled"
        assert deployed.index == pulled


def test_a_replica_whose_process_ends_is_restarted_as_kubernetes_restarts_a_container(tmp_path: Path) -> None:
    """The function's process killed: its watchdog ends with it (as of-watchdog does), the replica starts
    again on a port of its own, and the gateway routes to it there."""
    folder = region_folder(tmp_path)
    with rehearse_region(folder, {TOKEN_SECRET: b"t"}, {}, tmp_path / "logs") as deployed:
        url = f"{deployed.gateway.url}/function/probe"
        status, body, _ = post(url, {})
        assert status == 200
        killed = json.loads(body)["pid"]
        os.kill(killed, signal.SIGKILL)
        answers = []
        for _ in range(3000):  # however long a loaded machine takes to start it again
            status, body, _ = post(url, {})
            answers.append(status)
            if status == 200:
                break
            threading.Event().wait(0.1)
        assert answers[-1] == 200 and set(answers[:-1]) <= {500, 502}, answers
        assert json.loads(body)["pid"] != killed
        assert deployed.replicas[0].restarts == 1
    assert "index.py ended" in (tmp_path / "logs" / "probe-0.log").read_text()


def test_a_replica_over_its_memory_limit_is_killed_and_started_again(tmp_path: Path) -> None:
    """limits.memory (256Mi here), as the kernel holds a container to it: a call that makes the replica's
    processes hold more ends without an answer (OOMKilled, in the replica's log), and the replica is
    started again, as Kubernetes restarts the container."""
    folder = region_folder(tmp_path)
    with rehearse_region(folder, {TOKEN_SECRET: b"t"}, {}, tmp_path / "logs") as deployed:
        url = f"{deployed.gateway.url}/function/probe"
        status, body, _ = post(url, {})
        assert status == 200
        before = json.loads(body)["pid"]
        status, _, _ = post(url, {"allocate_mb": 400})
        assert status in (500, 502)
        for _ in range(3000):  # however long a loaded machine takes to start it again
            status, body, _ = post(url, {})
            if status == 200:
                break
            threading.Event().wait(0.1)
        assert status == 200 and json.loads(body)["pid"] != before
        assert (deployed.replicas[0].oom_kills, deployed.replicas[0].restarts) == (1, 1)
    assert "OOMKilled: " in (tmp_path / "logs" / "probe-0.log").read_text()


def test_a_busy_replica_answers_429_and_the_gateway_passes_it_back(tmp_path: Path) -> None:
    """max_inflight 1: a second call to the one replica while the first runs is answered 429 at once, and the
    gateway does not retry it; the first then ends normally."""
    folder = region_folder(tmp_path)
    started, release = tmp_path / "started", tmp_path / "release"
    with rehearse_region(folder, {TOKEN_SECRET: b"t"}, {}, tmp_path / "logs") as deployed:
        url = f"{deployed.gateway.url}/function/probe"
        first: list[Any] = []
        thread = threading.Thread(
            target=lambda: first.append(post(url, {"wait_for": str(release), "started": str(started)}))
        )
        thread.start()
        wait_for(started)
        status, body, _ = post(url, {})
        assert status == 429
        assert body.decode() == LIMIT_EXCEEDED.format(1)
        release.touch()
        thread.join()
        assert first[0][0] == 200
        calls = deployed.gateway.calls
        assert [c.status for c in calls] == [200, 429]  # the 429 was not tried again


def test_past_exec_timeout_the_watchdog_answers_504_and_the_function_runs_on(tmp_path: Path) -> None:
    """of-watchdog in http mode: 504 with no body past exec_timeout (its own header says so), passed on by
    the gateway; the function's code is not stopped, and the replica takes the next call."""
    folder = region_folder(tmp_path, exec_timeout="1s")
    started, release = tmp_path / "started", tmp_path / "release"
    with rehearse_region(folder, {TOKEN_SECRET: b"t"}, {}, tmp_path / "logs") as deployed:
        url = f"{deployed.gateway.url}/function/probe"
        status, body, headers = post(url, {"wait_for": str(release), "started": str(started)})
        assert (status, body) == (504, b"")
        assert headers["X-OpenFaaS-Internal"] == "of-watchdog"
        assert started.exists() and not release.exists()  # it ran, and still waits
        status, body, _ = post(url, {})  # the watchdog no longer counts the abandoned call
        assert status == 200, body
        release.touch()


def test_an_answer_past_the_watchdogs_write_timeout_never_arrives_and_the_gateway_says_502(tmp_path: Path) -> None:
    """A write_timeout shorter than exec_timeout (a stack edited by hand): the watchdog's server cannot write
    the answer, the gateway's upstream request ends without one, and CE answers 502 with no body."""
    folder = region_folder(tmp_path, exec_timeout="30s")
    stack = folder / "stack.yaml"
    stack.write_text(stack.read_text().replace('exec_timeout: "30s"', 'exec_timeout: "30s"\n      write_timeout: "1s"'))
    assert read_stack(stack)[0].write_timeout == 1.0
    started, release = tmp_path / "started", tmp_path / "release"
    with rehearse_region(folder, {TOKEN_SECRET: b"t"}, {}, tmp_path / "logs") as deployed:
        url = f"{deployed.gateway.url}/function/probe"
        status, body, _ = post(url, {"wait_for": str(release), "started": str(started)})
        assert (status, body) == (502, b"")
        release.touch()


def test_the_gateway_requires_its_basic_auth_on_system_routes_only(tmp_path: Path) -> None:
    folder = region_folder(tmp_path)
    with rehearse_region(folder, {TOKEN_SECRET: b"t"}, {}, tmp_path / "logs") as deployed:
        url = deployed.gateway.url
        for headers in ({}, {"Authorization": basic_auth_header("wrong")}):
            request = urllib.request.Request(f"{url}/system/secrets", headers=headers)
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(request, timeout=30)
            assert refused.value.code == 401
            status, _, _ = post(f"{url}/system/secrets", {"name": "x", "value": "y"}, headers)
            assert status == 401
        request = urllib.request.Request(
            f"{url}/system/secrets", headers={"Authorization": basic_auth_header(deployed.password)}
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            assert json.loads(response.read()) == [{"name": TOKEN_SECRET}]  # names only, never values
        assert post(f"{url}/function/probe", {})[0] == 200  # functions are not behind the gateway's auth


def test_a_stack_ce_would_refuse_is_refused(tmp_path: Path) -> None:
    folder = region_folder(tmp_path, replicas=6)
    with pytest.raises(RehearsalError, match="com.openfaas.scale.min is set too high for Community Edition"):
        read_stack(folder / "stack.yaml")
    folder.joinpath("stack.yaml").write_text(STACK.replace("cloudless-token", "absent-secret") % ("3s", 1, 1))
    with pytest.raises(RehearsalError, match="deploy probe: secret absent-secret not found"):
        with rehearse_region(folder, {TOKEN_SECRET: b"t"}, {}, tmp_path / "logs"):
            pass
    folder.joinpath("stack.yaml").write_text(STACK % ("soon", 1, 1))
    with pytest.raises(RehearsalError, match="exec_timeout: 'soon': expected a duration"):
        read_stack(folder / "stack.yaml")


def test_rehearse_only_with_the_openfaas_invoker(
    two_stages, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    build, _, _ = two_stages
    assert run_main([str(build), "--rehearse", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err == "cloudless-run: --rehearse: only with --invoker openfaas or lambda, not local\n"
    token = tmp_path / "token"
    token.write_text("abc\n")
    argv = [str(build), "--invoker", "openfaas", "--rehearse", "--token-file", str(token), "--out", str(tmp_path / "o")]
    assert run_main(argv) == 2
    assert capsys.readouterr().err.startswith("cloudless-run: --token-file: a rehearsal makes its own token")
    # a Lambda rehearsal has no token at all: the option's own refusal
    argv[2] = "lambda"
    assert run_main(argv) == 2
    assert capsys.readouterr().err == "cloudless-run: --token-file: only with --invoker openfaas, not lambda\n"
    assert not (tmp_path / "out").exists() and not (tmp_path / "o").exists()


@pytest.mark.slow
def test_a_rehearsal_of_the_mlp_in_two_stages_trains_as_plain_pytorch(
    compile_cli, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The compiled sample's stack deployed, the generated handlers behind the template's request handling,
    trained through the OpenFaaS invoker: plain PyTorch's parameters. No token given: the rehearsal makes one
    and a call without it is refused by the function."""
    build = tmp_path / "build"
    code, _, err = compile_cli(str(MLP), "-o", str(build), "-q", "--stages", "2")
    assert code == 0, err
    monkeypatch.delenv("CLOUDLESS_TOKEN", raising=False)
    workflow = load_workflow(build / "workflow.yaml")
    region = workflow.regions[0].name
    iterations = 12
    out = tmp_path / "out"
    code = run_main(
        [str(build), "--invoker", "openfaas", "--rehearse", "--iterations", str(iterations)]
        + ["--out", str(out), "--run-id", "rehearsal"]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "rehearsal: OpenFaaS gateway http://127.0.0.1:" in captured.out
    expected = plain_training(load_model_file(MLP), workflow, region, iterations)
    params = load_file(out / "model.safetensors")
    assert set(params) == set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-6, msg=name)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["status"] == "done" and metrics["invoker"] == "openfaas"
    replicas = sum(f.replicas for f in workflow.regions[0].functions)
    logs = sorted(p.name for p in (out / "logs" / "openfaas").iterdir())
    assert len(logs) == replicas  # one log per replica process

    # The same deployment: a call without the token, or with another, is refused by the generated handler.
    first = workflow.regions[0].functions[0].name
    secrets = {TOKEN_SECRET: b"right\n", STORAGE_SECRET: b""}
    with rehearse_region(build / "regions" / region, secrets, {}, tmp_path / "logs") as deployed:
        for headers in ({}, {TOKEN_HEADER: "wrong"}):
            status, body, _ = post(f"{deployed.gateway.url}/function/{first}", {"iteration": 0}, headers)
            assert status == 401 and b"unauthorized" in body


@pytest.mark.slow
def test_replicas_oomkilled_mid_run_are_restarted_and_the_run_trains_the_undisturbed_model(
    compile_cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--inject-faults` in the OpenFaaS rehearsal kills the replica serving the call (OOMKilled, in its log),
    which Kubernetes' restart brings back: the cut call is retried with a new attempt, whose calls are sent
    again while the replica starts, and the model is the one of a run without faults, bit for bit."""
    build = tmp_path / "build"
    code, _, err = compile_cli(str(MLP), "-o", str(build), "-q", "--stages", "2")
    assert code == 0, err
    monkeypatch.delenv("CLOUDLESS_TOKEN", raising=False)
    argv = [str(build), "--iterations", "12", "-q"]
    assert run_main([*argv, "--out", str(tmp_path / "undisturbed")]) == 0
    out = tmp_path / "out"
    faults = ["--inject-faults", "0.3", "--fault-seed", "1"]
    assert run_main([*argv, "--invoker", "openfaas", "--rehearse", *faults, "--out", str(out)]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    killed = metrics["faults_injected"]
    assert metrics["status"] == "done" and killed >= 1 and metrics["retries"] >= killed
    logs = "".join(p.read_text() for p in (out / "logs" / "openfaas").glob("*.log"))
    assert logs.count("OOMKilled: --inject-faults") == killed
    expected = load_file(tmp_path / "undisturbed" / "model.safetensors")
    params = load_file(out / "model.safetensors")
    assert set(params) == set(expected) and all(torch.equal(params[k], v) for k, v in expected.items())
