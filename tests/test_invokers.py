"""`cloudless-run --invoker openfaas` over real HTTP, through a gateway shaped like OpenFaaS CE's: each
function's replicas are instances of the python3-http template's request handling behind the watchdog's
max_inflight 1, the provider routes each call to a random instance, and the queue-worker delivers
asynchronous calls one at a time. The invoker calls the synchronous route /function/<name>, each call
held open by a thread, tries a 429 (a busy instance) again, and training is exactly what `cloudless-run`'s
local processes and plain PyTorch compute. A function the gateway does not serve fails the run with its
name. Every call carries the run's token (the functions' secret cloudless-token), which is never printed."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from cloudless.ir.protocol import STORAGE_ENV, TOKEN_ENV, TOKEN_HEADER, TOKEN_SECRET
from cloudless.ir.workflow import Workflow
from cloudless.runtimes.cli import main as run_main
from cloudless.runtimes.rehearsal.openfaas_gateway import load_handler, results, serve_gateway
from cloudless.runtimes.storage.channels import DirectoryChannel
from tests.conftest import TWO_STAGE_ITERATIONS
from tests.runtime_cases import MLP, reference_training, write_training_data

ITERATIONS = TWO_STAGE_ITERATIONS  # the two_stages build's (tests/conftest.py)
TOKEN = "0d9c2b7e4f6a8c1e3b5d7f9a2c4e6b8d"


def handlers(build: Path, workflow: Workflow) -> dict[str, Any]:
    """Each function's handler.py, loaded once (one warm instance per function).

    Every handler puts its own package folder on sys.path and imports the vendored
    `cloudless.runtimes` from it; in one process the first import wins and the other packages share
    it. That is fine: each package vendors an identical copy of the runtime."""
    return {
        f.name: load_handler(build / f.package, f"handler_{f.name.replace('-', '_')}")
        for f in workflow.regions[0].functions
    }


def local_run(build: Path, result: Any, workflow: Workflow, tmp_path: Path) -> dict[str, torch.Tensor]:
    """`cloudless-run`'s own run of the build (local processes, storage a folder): the trained parameters."""
    storage, out = tmp_path / "local-storage", tmp_path / "local"
    write_training_data(result, DirectoryChannel(storage), workflow.regions[0].name)
    argv = [str(build), "--storage", str(storage), "--out", str(out), "--model", str(MLP), "-q", "--run-id", "local"]
    assert run_main(argv) == 0
    return load_file(out / "model.safetensors")


@pytest.mark.slow
def test_openfaas_trains_through_the_synchronous_route_of_a_ce_gateway(two_stages, tmp_path: Path, monkeypatch) -> None:
    """Two runs through one CE-like gateway: cold handlers, then the same instances warm (as deployed
    functions stay between runs). Each replica holds exactly one call at a time, and each run trains
    what `cloudless-run` trains locally and what plain PyTorch computes."""
    build, workflow, result = two_stages
    region = workflow.regions[0].name
    storage = tmp_path / "storage"
    write_training_data(result, DirectoryChannel(storage), region)
    expected = reference_training(result, workflow, region)
    local = local_run(build, result, workflow, tmp_path)
    monkeypatch.setenv(STORAGE_ENV, str(storage))  # what the functions' deployment sets
    token_file = tmp_path / "run.token"
    token_file.write_text(TOKEN + "\n")
    replicas = {f.name: f.replicas for f in workflow.regions[0].functions}
    with serve_gateway(
        handlers(build, workflow), {TOKEN_SECRET: TOKEN}, replicas=replicas, max_inflight=1, queue="ce"
    ) as gateway:
        for run_id in ("cold", "warm"):
            out = tmp_path / run_id
            code = run_main(
                [
                    *(str(build), "--invoker", "openfaas", "--gateway", gateway.url, "--run-id", run_id),
                    *("--storage", str(storage), "--out", str(out), "--model", str(MLP), "-q"),
                    *("--token-file", str(token_file)),
                ]
            )
            calls = [c for c in gateway.calls if json.loads(c.body)["run"] == run_id]
            replies = [(c.function, c.instance, c.status, c.reply) for c in calls]
            assert code == 0, replies
            # Only the synchronous route; every call answered 200 (a result) or 429 (a busy instance,
            # tried again), and every replica of every function ran once, each on an instance of its own.
            assert {c.route for c in calls} == {"sync"}
            assert {c.status for c in calls} <= {200, 429}, replies
            ran = [c for c in calls if c.status == 200]
            assert sorted((c.function, json.loads(c.body)["replica"]) for c in ran) == [
                ("mlp-digits-s0", 0),
                ("mlp-digits-s0", 1),
                ("mlp-digits-s1", 0),
            ]
            assert sorted((c.function, c.instance) for c in ran) == [
                ("mlp-digits-s0", 0),
                ("mlp-digits-s0", 1),
                ("mlp-digits-s1", 0),
            ]
            assert all(r is not None and r["status"] == "done" for r in results(ran)), replies
            assert all(c.headers.get(TOKEN_HEADER) == TOKEN for c in calls)
            # The two replicas of stage 0 ran at the same time as stage 1 (a pipeline, not a queue).
            assert max(c.began for c in ran) < min(c.ended for c in ran)

            params = load_file(out / "model.safetensors")
            assert set(params) == set(expected) == set(local)
            for name, value in expected.items():
                torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-6, msg=f"{run_id}: {name}")
                assert torch.equal(params[name], local[name]), f"{run_id}: {name} differs from the local run"
            metrics = json.loads((out / "metrics.json").read_text())
            assert metrics["invocations"] == 3 and metrics["retries"] == 0
            assert [p["iteration"] for p in metrics["progress"]] == list(range(ITERATIONS))
            assert all(0 < p["loss"] < 5 for p in metrics["progress"])
        # No instance ever ran two calls at once (the watchdog's max_inflight 1 held).
        assert all(w.most == 1 for ws in gateway.instances.values() for w in ws)


def test_the_ce_gateway_shape(tmp_path: Path) -> None:
    """What the invoker relies on and what it avoids, on stub functions: the synchronous route runs calls
    to different instances at once and passes an instance's 429 back; CE's queue-worker delivers
    asynchronous calls one at a time, so a call waiting on a partner queued behind it waits forever."""
    running: list[int] = []
    most = [0]
    lock = threading.Lock()

    def slow(event: Any, context: Any) -> dict[str, Any]:
        with lock:
            running.append(1)
            most[0] = max(most[0], len(running))
        time.sleep(0.3)
        with lock:
            running.pop()
        return {"statusCode": 200, "body": json.dumps({"ok": True})}

    stub = SimpleNamespace(handle=slow)

    def post(url: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(urllib.request.Request(url, data=b"{}", method="POST")) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    def at_once(url: str, n: int) -> list[int]:
        statuses: list[int] = []
        threads = [threading.Thread(target=lambda: statuses.append(post(url)[0])) for _ in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return sorted(statuses)

    with serve_gateway({"one": stub, "two": stub}, replicas={"one": 1, "two": 2}, queue="ce") as gateway:
        # One instance, max_inflight 1: of two calls at once, one runs and one is refused (429).
        assert at_once(f"{gateway.url}/function/one", 2) == [200, 429]
        refused = [c for c in gateway.calls if c.status == 429]
        assert len(refused) == 1 and refused[0].reply.startswith("Concurrent request limit exceeded")
        # The asynchronous route: 202 at once, delivered one at a time by the queue worker.
        for _ in range(3):
            status, _ = post(f"{gateway.url}/async-function/two")
            assert status == 202
        assert gateway.wait(timeout=10)
        queued = [c for c in gateway.calls if c.route == "async"]
        assert len(queued) == 3 and all(c.status == 200 for c in queued)
        for before, after in zip(queued, queued[1:], strict=False):
            assert after.began >= before.ended  # never two at once, though "two" has two instances
        # A function it does not serve: 404 on both routes.
        assert post(f"{gateway.url}/function/absent")[0] == 404
        assert post(f"{gateway.url}/async-function/absent")[0] == 404
    assert most[0] <= 2


def test_a_function_the_gateway_does_not_serve_fails_the_run(
    two_stages, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    build, workflow, _ = two_stages
    monkeypatch.setenv(TOKEN_ENV, TOKEN)  # the token from the environment this time
    first, last = workflow.regions[0].functions

    def done(event: Any, context: Any) -> dict[str, Any]:
        """Stage 0 answers at once as if it had trained (a real one would wait for stage 1's gradients)."""
        replica = json.loads(event.body)["replica"]
        result = {"status": "done", "function": first.name, "replica": replica, "start": 0, "stop": ITERATIONS}
        return {"statusCode": 200, "body": json.dumps(result)}

    began = time.monotonic()
    with serve_gateway({first.name: SimpleNamespace(handle=done)}, replicas={first.name: first.replicas}) as gateway:
        code = run_main(
            [
                *(
                    str(build),
                    "--invoker",
                    "openfaas",
                    "--gateway",
                    gateway.url,
                    "--retries",
                    "0",
                    "--key-timeout",
                    "600",
                ),
                *("--storage", str(tmp_path / "storage"), "--out", str(tmp_path / "out"), "--model", str(MLP), "-q"),
            ]
        )
    err = capsys.readouterr().err
    assert code == 1, err
    assert f"the run failed: {last.name} replica 0 from iteration 0" in err
    assert f"{last.name} answered 404: error finding function {last.name}: not found" in err
    assert sorted({c.function for c in gateway.calls if c.status == 200}) == [first.name]
    # What it did is recorded (valid JSON, saying it failed and why); no trained model is written.
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert metrics["status"] == "failed" and f"{last.name} replica 0" in metrics["error"]
    assert not (tmp_path / "out" / "model.safetensors").exists()
    assert time.monotonic() - began < 300  # not the 600 s a wait for stage 1's keys would take
    assert {c.headers.get(TOKEN_HEADER) for c in gateway.calls} == {TOKEN}
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
    """Through the gateway's synchronous route: a call with a wrong token or none is answered 401 by the
    function, which writes nothing to storage."""
    build, workflow, _ = two_stages
    storage = tmp_path / "storage"
    monkeypatch.setenv(STORAGE_ENV, str(storage))
    first = workflow.regions[0].functions[0]
    served = {first.name: load_handler(build / first.package, "handler_wrong_token")}
    body = json.dumps({"iteration": 0, "replica": 0}).encode()
    with serve_gateway(served, {TOKEN_SECRET: TOKEN}) as gateway:
        for headers in ({}, {TOKEN_HEADER: "not-the-token"}):
            request = urllib.request.Request(
                f"{gateway.url}/function/{first.name}", data=body, headers=headers, method="POST"
            )
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(request)
            assert refused.value.code == 401
    assert [c.status for c in gateway.calls] == [401, 401]
    assert not storage.exists()


class Front:
    """A TCP front for the gateway that can restart: while down, connections to its port are refused and
    those it was carrying are cut, as when the gateway's pod restarts; then it serves on the same port."""

    def __init__(self, target: str) -> None:
        self.target = urllib.parse.urlsplit(target)
        self.listener = self._listen(0)
        self.port = self.listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.carried: list[socket.socket] = []
        self.lock = threading.Lock()
        self.serving = threading.Thread(target=self._accept, args=(self.listener,), daemon=True)
        self.serving.start()

    @staticmethod
    def _listen(port: int) -> socket.socket:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen(64)
        return listener

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # closed: down
            upstream = socket.create_connection((self.target.hostname, self.target.port))
            with self.lock:
                self.carried += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        for end in (source, sink):
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)

    def restart(self, down_s: float) -> None:
        """Down for `down_s` seconds (every carried connection cut), then up again on the same port."""
        self.listener.close()
        with self.lock:
            carried, self.carried = self.carried, []
        for end in carried:
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)
        time.sleep(down_s)  # the outage itself, not a wait for a condition
        self.listener = self._listen(self.port)
        self.serving = threading.Thread(target=self._accept, args=(self.listener,), daemon=True)
        self.serving.start()


@pytest.mark.slow
@pytest.mark.parametrize("down_s", [0.5, 5.0])
def test_a_gateway_restarting_mid_run_is_ridden_out_to_the_same_model(
    two_stages, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, down_s: float
) -> None:
    """The gateway goes away once checkpoints are written (its port refused, the calls it carried cut) and
    comes back: calls that reached no function are sent again, the cut ones retried with a new attempt
    (whose calls wait for the instances their first attempt still holds), and the run ends with the model
    of an undisturbed run, bit for bit."""
    build, workflow, result = two_stages
    region = workflow.regions[0].name
    iterations = "30"
    storage = tmp_path / "storage"
    write_training_data(result, DirectoryChannel(storage), region)
    undisturbed = tmp_path / "undisturbed"
    argv = [str(build), "--model", str(MLP), "-q", "--iterations", iterations]
    local = [*argv, "--storage", str(tmp_path / "local-storage"), "--out", str(undisturbed)]
    write_training_data(result, DirectoryChannel(tmp_path / "local-storage"), region)
    assert run_main(local) == 0
    monkeypatch.setenv(STORAGE_ENV, str(storage))
    token_file = tmp_path / "run.token"
    token_file.write_text(TOKEN + "\n")
    replicas = {f.name: f.replicas for f in workflow.regions[0].functions}
    ended, restarted = threading.Event(), threading.Event()

    def restart_once_checkpointed(front: Front) -> None:
        # A condition, not a time: stage 0's checkpoint at iteration 4 or later is in storage.
        while not ended.is_set():
            found = [int(p.name[2:]) for p in storage.glob("*/*/state/s0/it*")]
            if found and max(found) >= 4:
                front.restart(down_s)
                restarted.set()
                return
            time.sleep(0.01)

    with serve_gateway(handlers(build, workflow), {TOKEN_SECRET: TOKEN}, replicas=replicas) as gateway:
        front = Front(gateway.url)
        watcher = threading.Thread(target=restart_once_checkpointed, args=(front,), daemon=True)
        watcher.start()
        out = tmp_path / "out"
        code = run_main(
            [*argv, "--invoker", "openfaas", "--gateway", front.url, "--token-file", str(token_file),
             "--storage", str(storage), "--out", str(out), "--run-id", "restarted"]
        )  # fmt: skip
        ended.set()
    assert code == 0
    watcher.join()
    assert restarted.is_set()  # mid-run
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["status"] == "done" and metrics["retries"] >= 1  # the calls it cut: new attempts
    expected = load_file(undisturbed / "model.safetensors")
    params = load_file(out / "model.safetensors")
    assert set(params) == set(expected)
    for name, value in expected.items():
        assert torch.equal(params[name], value), name
