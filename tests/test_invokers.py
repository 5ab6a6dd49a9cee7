"""`cloudless-run --invoker openfaas` over real HTTP: a gateway shaped like OpenFaaS's asynchronous
endpoint (202 at once, the function run in the background) runs the generated handlers, the
controller follows them through their completion markers in storage, and training is exactly what
plain PyTorch computes. A function the gateway does not serve fails the run with its name. Every call
carries the run's token (the functions' secret cloudless-token), which is never printed."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from cloudless.ir.protocol import STORAGE_ENV, TOKEN_ENV, TOKEN_HEADER, TOKEN_SECRET
from cloudless.ir.workflow import Workflow
from cloudless.runtimes.run import main as run_main
from cloudless.runtimes.storage import DirectoryChannel
from tests.openfaas_server import load_handler, serve_gateway
from tests.runtime_cases import MLP, front_end, reference_training, write_packages, write_training_data

ITERATIONS = 3
TOKEN = "0d9c2b7e4f6a8c1e3b5d7f9a2c4e6b8d"


@pytest.fixture(scope="module")
def two_stages(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Workflow, Any]:
    """A 2-stage build of the MLP with replicas (2, 1), and the front end's result."""
    torch.set_num_threads(1)  # the functions run as threads of this process
    result = front_end()
    n = len(result.chain.blocks)
    build = tmp_path_factory.mktemp("openfaas") / "build"
    workflow = write_packages(
        result, build, [(0, 1, 2), (2, n - 1, 1)], micro_batch=8, global_batch=32, iterations=ITERATIONS
    )
    return build, workflow, result


def handlers(build: Path, workflow: Workflow) -> dict[str, Any]:
    """Each function's handler.py, loaded once (one warm instance per function).

    Every handler puts its own package folder on sys.path and imports the vendored
    `cloudless.runtimes` from it; in one process the first import wins and the other packages share
    it. That is fine: each package vendors an identical copy of the runtime."""
    return {
        f.name: load_handler(build / f.package, f"handler_{f.name.replace('-', '_')}")
        for f in workflow.regions[0].functions
    }


def test_openfaas_runs_over_http_match_plain_pytorch(two_stages, tmp_path: Path, monkeypatch) -> None:
    """Two runs through one gateway: cold handlers, then the same handlers warm (as deployed functions
    stay between runs). Each trains exactly what plain PyTorch does."""
    build, workflow, result = two_stages
    region = workflow.regions[0].name
    storage = tmp_path / "storage"
    write_training_data(result, DirectoryChannel(storage), region)
    monkeypatch.setenv(STORAGE_ENV, str(storage))  # what the functions' deployment sets
    expected = reference_training(result, workflow, region)
    token_file = tmp_path / "run.token"
    token_file.write_text(TOKEN + "\n")
    began = time.monotonic()
    with serve_gateway(handlers(build, workflow), {TOKEN_SECRET: TOKEN}) as gateway:
        for run_id in ("cold", "warm"):
            out = tmp_path / run_id
            code = run_main(
                [
                    *(str(build), "--invoker", "openfaas", "--gateway", gateway.url, "--run-id", run_id),
                    *("--storage", str(storage), "--out", str(out), "--model", str(MLP), "-q"),
                    *("--token-file", str(token_file)),
                ]
            )
            assert gateway.wait(timeout=30), f"{run_id}: calls still running after the run ended"
            calls = [c for c in gateway.calls if json.loads(c.body)["run"] == run_id]
            replies = [(c.function, c.status, c.reply) for c in calls]
            assert code == 0, replies
            # Every replica of every function was invoked once through the gateway, and each succeeded.
            assert sorted((c.function, json.loads(c.body)["replica"]) for c in calls) == [
                ("mlp-digits-s0", 0),
                ("mlp-digits-s0", 1),
                ("mlp-digits-s1", 0),
            ]
            assert all(c.status == 200 and json.loads(c.reply)["status"] == "done" for c in calls), replies
            assert all(c.headers.get(TOKEN_HEADER) == TOKEN for c in calls)

            params = load_file(out / "model.safetensors")
            assert set(params) == set(expected)
            for name, value in expected.items():
                torch.testing.assert_close(
                    params[name], value, rtol=1e-5, atol=1e-6, msg=lambda m, n=f"{run_id}: {name}": f"{n}: {m}"
                )
            metrics = json.loads((out / "metrics.json").read_text())
            assert metrics["invocations"] == 3 and metrics["retries"] == 0
            assert [p["iteration"] for p in metrics["progress"]] == list(range(ITERATIONS))
            assert all(0 < p["loss"] < 5 for p in metrics["progress"])
    assert time.monotonic() - began < 60


def test_a_function_the_gateway_does_not_serve_fails_the_run(
    two_stages, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    build, workflow, _ = two_stages
    monkeypatch.setenv(TOKEN_ENV, TOKEN)  # the token from the environment this time
    first, last = workflow.regions[0].functions
    # Stage 0 is served by a stub that returns at once (a real one would wait for stage 1's
    # gradients until its key timeout); stage 1 is not served at all.
    stub = SimpleNamespace(handle=lambda event, context: {"statusCode": 200, "body": "{}"})
    began = time.monotonic()
    with serve_gateway({first.name: stub}) as gateway:
        # The gateway's shape: 202 and a call id at once for a function it serves, 404 otherwise.
        with urllib.request.urlopen(
            urllib.request.Request(f"{gateway.url}/async-function/{first.name}", data=b"{}", method="POST")
        ) as response:
            assert response.status == 202 and response.headers["X-Call-Id"]
        with pytest.raises(urllib.error.HTTPError) as missing:
            urllib.request.urlopen(
                urllib.request.Request(f"{gateway.url}/async-function/{last.name}", data=b"{}", method="POST")
            )
        assert missing.value.code == 404
        code = run_main(
            [
                *(str(build), "--invoker", "openfaas", "--gateway", gateway.url, "--retries", "0"),
                *("--storage", str(tmp_path / "storage"), "--out", str(tmp_path / "out"), "--model", str(MLP), "-q"),
            ]
        )
        assert gateway.wait(timeout=5)
    err = capsys.readouterr().err
    assert code == 1, err
    assert f"the run failed: {last.name} replica 0 from iteration 0" in err
    assert [c.function for c in gateway.calls] == [first.name] * (1 + first.replicas)
    # What it did is recorded (valid JSON, saying it failed and why); no trained model is written.
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert metrics["status"] == "failed" and f"{last.name} replica 0" in metrics["error"]
    assert not (tmp_path / "out" / "model.safetensors").exists()
    assert time.monotonic() - began < 20
    assert [c.headers.get(TOKEN_HEADER) for c in gateway.calls[1:]] == [TOKEN] * first.replicas
    # The token is never printed nor written with the run's outputs.
    assert TOKEN not in err
    assert not [p for p in (tmp_path / "out").rglob("*") if p.is_file() and TOKEN.encode() in p.read_bytes()]


def test_the_openfaas_invoker_needs_the_token(
    two_stages, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """No token, an empty or unreadable token file, or one that cannot be a header: one line, exit 2, and
    nothing invoked or written; --token-file with another invoker is refused too."""
    build, _, _ = two_stages
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    empty, binary, spaced = tmp_path / "empty", tmp_path / "binary", tmp_path / "spaced"
    empty.write_text("\n")
    binary.write_bytes(b"\xff\xfe")
    spaced.write_text("two words\n")
    cases = [
        ([], "give --token-file FILE or set CLOUDLESS_TOKEN"),
        (["--token-file", str(empty)], f"--token-file {empty}: empty"),
        (["--token-file", str(tmp_path / "absent")], "cannot be read"),
        (["--token-file", str(binary)], "cannot be read"),
        (["--token-file", str(spaced)], "expected one word of printable ASCII"),
    ]
    out = tmp_path / "out"
    with serve_gateway({}) as gateway:
        for extra, message in cases:
            argv = [str(build), "--invoker", "openfaas", "--gateway", gateway.url, "--out", str(out), *extra]
            assert run_main(argv) == 2
            err = capsys.readouterr().err
            assert err.startswith("cloudless-run: ") and message in err and err.count("\n") == 1, err
            assert "two words" not in err
            assert not out.exists()
        assert gateway.calls == []
    assert run_main([str(build), "--token-file", str(spaced), "--out", str(out)]) == 2
    assert "--token-file: only with --invoker openfaas, not local" in capsys.readouterr().err


def test_the_gateway_passes_a_wrong_token_on_and_the_function_refuses_it(
    two_stages, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the gateway's asynchronous endpoint: a call with a wrong token or none is queued (202) and
    answered 401 by the function, which writes nothing to storage."""
    build, workflow, _ = two_stages
    storage = tmp_path / "storage"
    monkeypatch.setenv(STORAGE_ENV, str(storage))
    first = workflow.regions[0].functions[0]
    served = {first.name: load_handler(build / first.package, "handler_wrong_token")}
    body = json.dumps({"iteration": 0, "replica": 0}).encode()
    with serve_gateway(served, {TOKEN_SECRET: TOKEN}) as gateway:
        for headers in ({}, {TOKEN_HEADER: "not-the-token"}):
            request = urllib.request.Request(
                f"{gateway.url}/async-function/{first.name}", data=body, headers=headers, method="POST"
            )
            with urllib.request.urlopen(request) as response:
                assert response.status == 202
        assert gateway.wait(timeout=10)
    assert [c.status for c in gateway.calls] == [401, 401]
    assert not storage.exists()
