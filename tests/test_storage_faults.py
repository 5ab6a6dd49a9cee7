"""Transient storage faults, injected below the SDKs' retries (`--inject-storage-faults`, against moto's S3
over HTTP and a real redis-server), are ridden out: every request answers as without them, a claim whose
answer was lost is still its caller's, a Redis restart is waited out, and a run trains exactly the model an
undisturbed run trains."""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from cloudless.ir.protocol import S3_ENDPOINT_ENV, STORAGE_FAULTS_ENV
from cloudless.runtimes.cli import main as run_main
from cloudless.runtimes.storage.channels import Channel, RedisChannel, RidingOut, S3Channel
from cloudless.runtimes.storage.transient import S3_FAULTS, StorageFaults
from tests.conftest import _stop, private_redis
from tests.runtime_cases import MLP, front_end, write_packages

ITERATIONS = 4


def exercise(channel: Channel, count: int) -> None:
    """Writes, reads and claims whose answers must be what storage without faults gives."""
    for i in range(count):
        value = uuid.uuid4().bytes * 300
        channel.put(f"value/{i}", value)
        assert channel.try_get(f"value/{i}") == value
        assert channel.try_get(f"missing/{i}") is None
        mine = uuid.uuid4().hex.encode()
        assert channel.claim(f"claim/{i}", mine) is True, i  # a lost answer is still this call's claim
        assert channel.claim(f"claim/{i}", b"another caller") is False
        assert channel.try_get(f"claim/{i}") == mine


#: the default lane's kinds; the others in the slow lane (a SlowDown's retries wait seconds: botocore's
#: back-off starts at 1 s for throttling, as S3's guidance asks)
FAST_KINDS = ("answer-lost", "body-cut")


@pytest.mark.parametrize(
    "kind", [pytest.param(k, marks=() if k in FAST_KINDS else pytest.mark.slow) for k in S3_FAULTS]
)
def test_every_kind_of_s3_fault_is_ridden_out(kind: str, s3_bucket: str, moto_endpoint: str, monkeypatch) -> None:
    monkeypatch.setenv(STORAGE_FAULTS_ENV, StorageFaults(0.3, seed=1, kinds=(kind,)).encode())
    raw = S3Channel(s3_bucket, "faults", endpoint_url=moto_endpoint)
    exercise(RidingOut(raw, 60), 8)
    assert raw.faults is not None and raw.faults.injected.get(kind, 0) >= 3, raw.faults.injected


def test_a_claim_whose_answer_was_lost_is_the_callers(s3_bucket: str, moto_endpoint: str, monkeypatch) -> None:
    """For a second, every request is served and its answer lost: the claim's first try wrote it, and
    each retry meets 412 (the key exists) until an answer arrives. The claim is still this caller's."""
    monkeypatch.setenv(STORAGE_FAULTS_ENV, StorageFaults(1.0, until=time.time() + 1, kinds=("answer-lost",)).encode())
    raw = S3Channel(s3_bucket, "lost", endpoint_url=moto_endpoint)
    assert RidingOut(raw, 60).claim("claim", b"mine") is True
    assert raw.faults is not None and raw.faults.injected["answer-lost"] >= 1
    assert raw.try_get("claim") == b"mine" and raw.claim("claim", b"theirs") is False


def test_a_burst_begins_at_its_iteration_and_lasts_its_seconds(monkeypatch) -> None:
    """A burst of faults (every request failing) begins at the process's first request on a key of the
    iteration given or a later one, not before, and ends `seconds` later; the encoding round-trips."""
    burst = StorageFaults(1.0, kinds=("slow-down",), from_iteration=2, seconds=0.3)
    monkeypatch.setenv(STORAGE_FAULTS_ENV, burst.encode())
    assert StorageFaults.from_env() == burst
    drawer = burst.drawer(S3_FAULTS)
    assert drawer.draw("http://s3/bucket/run/r/it1/act/s0/mb0") is None
    assert drawer.draw("http://s3/bucket/run/r/state/s0/latest") is None
    assert drawer.draw("http://s3/bucket/run/r/it12/grad/s1/mb3") == "slow-down"  # 12 >= 2: it begins
    assert drawer.draw("http://s3/bucket/run/r/it1/act/s0/mb0") == "slow-down"  # begun: every request
    began = time.monotonic()
    while time.monotonic() - began <= 0.3:
        time.sleep(0.05)
    assert drawer.draw("http://s3/bucket/run/r/it13/act/s0/mb0") is None
    monkeypatch.setenv(STORAGE_FAULTS_ENV, json.dumps({"share": 1, "from_iteration": 2, "seconds": -1}))
    with pytest.raises(ValueError, match="seconds >= 0"):
        StorageFaults.from_env()


def test_redis_faults_are_ridden_out(redis_url: str, monkeypatch) -> None:
    monkeypatch.setenv(STORAGE_FAULTS_ENV, StorageFaults(0.3, seed=2).encode())
    raw = RedisChannel(redis_url, f"faults-{uuid.uuid4().hex[:8]}")
    exercise(RidingOut(raw, 60), 12)
    assert raw.faults is not None and set(raw.faults.injected) == {"drop-before", "answer-lost"}, raw.faults.injected


@pytest.mark.slow
def test_a_redis_restart_of_5_s_is_ridden_out(tmp_path: Path) -> None:
    server, port, executable = private_redis(tmp_path)
    channel = RidingOut(RedisChannel(f"redis://127.0.0.1:{port}/0"), 60)
    channel.put("before", b"1")
    _stop(server)
    restarted: list[subprocess.Popen[bytes]] = []

    def restart() -> None:
        time.sleep(5)
        command = [executable, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        restarted.append(subprocess.Popen([*command, "--dir", str(tmp_path)], stdout=subprocess.DEVNULL))

    thread = threading.Thread(target=restart)
    thread.start()
    try:
        began = time.monotonic()
        channel.put("after", b"2")  # waits for the server, then writes
        assert time.monotonic() - began >= 4 and channel.try_get("after") == b"2"
    finally:
        thread.join()
        for process in restarted:
            _stop(process)


# -- whole runs -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_stages_replicated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The MLP in 2 stages with replicas (2, 1) for ITERATIONS iterations."""
    result = front_end()
    n_blocks = len(result.chain.blocks)
    build = tmp_path_factory.mktemp("faults") / "build"
    stages = [(0, n_blocks - 2, 2), (n_blocks - 1, n_blocks - 1, 1)]
    write_packages(result, build, stages, micro_batch=8, global_batch=32, iterations=ITERATIONS)
    return build


def trained(build: Path, out: Path, *options: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    code = run_main([str(build), "--out", str(out), "--model", str(MLP), "-q", "--no-verify-build", *options])
    assert code == 0
    return json.loads((out / "metrics.json").read_text()), load_file(out / "model.safetensors")


def assert_same(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(expected)
    for name, value in expected.items():
        assert torch.equal(got[name], value), name


@pytest.fixture(scope="module")
def undisturbed(two_stages_replicated: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    return trained(two_stages_replicated, tmp_path_factory.mktemp("undisturbed"))[1]


@pytest.mark.slow
def test_a_run_on_s3_with_faults_trains_the_undisturbed_model(
    two_stages_replicated: Path, undisturbed, s3_bucket: str, moto_endpoint: str, tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setenv(S3_ENDPOINT_ENV, moto_endpoint)  # the functions' too: they inherit it
    storage = f"s3://{s3_bucket}/run"
    metrics, params = trained(
        two_stages_replicated, tmp_path, "--storage", storage, "--inject-storage-faults", "0.15", "--fault-seed", "4"
    )
    assert metrics["status"] == "done" and metrics["retries"] == 0  # ridden out inside the invocations
    assert_same(params, undisturbed)


@pytest.mark.slow
def test_a_run_on_redis_with_faults_trains_the_undisturbed_model(
    two_stages_replicated: Path, undisturbed, redis_url: str, tmp_path: Path
) -> None:
    storage = f"{redis_url}#faults-{uuid.uuid4().hex[:8]}"
    metrics, params = trained(two_stages_replicated, tmp_path, "--storage", storage, "--inject-storage-faults", "0.2")
    assert metrics["status"] == "done" and metrics["retries"] == 0
    assert_same(params, undisturbed)


def test_storage_faults_need_storage_that_has_them(two_stages_replicated: Path, tmp_path: Path, capsys) -> None:
    code = run_main([str(two_stages_replicated), "--out", str(tmp_path / "out"), "--inject-storage-faults", "0.1"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "the default storage (OUT/storage) is a folder, which has no transient errors; give --storage s3://" in err
    assert not (tmp_path / "out").exists()


# -- the rehearsals: the deployed path, with the same faults ----------------------------------------------

REHEARSED_ITERATIONS = 6


@pytest.fixture(scope="module")
def sample_build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The digits sample compiled in 2 stages (its SAM and OpenFaaS files), as a user compiles it."""
    from cloudless.compiler.cli import main as compile_main

    build = tmp_path_factory.mktemp("sample") / "build"
    assert compile_main([str(MLP), "-o", str(build), "-q", "--stages", "2", "--repeats", "1"]) == 0
    return build


@pytest.fixture(scope="module")
def sample_undisturbed(sample_build: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    out = tmp_path_factory.mktemp("sample_undisturbed")
    return trained(sample_build, out, "--iterations", str(REHEARSED_ITERATIONS))[1]


@pytest.mark.slow
def test_the_lambda_rehearsal_with_storage_faults_trains_the_undisturbed_model(
    sample_build: Path, sample_undisturbed, tmp_path: Path, aws_env: None
) -> None:
    """Through SAM's stack, Step Functions and Lambda's runtime interface client, against moto's S3, 10% of the
    functions' and the driver's requests failing."""
    metrics, params = trained(
        sample_build, tmp_path, "--invoker", "lambda", "--rehearse", "--iterations", str(REHEARSED_ITERATIONS),
        "--inject-storage-faults", "0.1",
    )  # fmt: skip
    assert metrics["status"] == "done"
    assert_same(params, sample_undisturbed)


@pytest.mark.slow
def test_the_openfaas_rehearsal_with_storage_faults_trains_the_undisturbed_model(
    sample_build: Path, sample_undisturbed, s3_bucket: str, moto_endpoint: str, tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setenv(S3_ENDPOINT_ENV, moto_endpoint)  # the rehearsal passes it on to the replicas
    monkeypatch.delenv("CLOUDLESS_TOKEN", raising=False)
    metrics, params = trained(
        sample_build, tmp_path, "--invoker", "openfaas", "--rehearse", "--iterations", str(REHEARSED_ITERATIONS),
        "--storage", f"s3://{s3_bucket}/rehearsed", "--inject-storage-faults", "0.1",
    )  # fmt: skip
    assert metrics["status"] == "done"
    assert_same(params, sample_undisturbed)


# -- throttled invokes --------------------------------------------------------------------------------------


@pytest.mark.slow
def test_throttled_invokes_are_retried_by_the_state_machine_and_change_nothing(
    sample_build: Path, sample_undisturbed, tmp_path: Path, aws_env: None, capsys
) -> None:
    code = run_main(
        [str(sample_build), "--out", str(tmp_path), "--model", str(MLP), "--no-verify-build", "--invoker", "lambda",
         "--rehearse", "--iterations", str(REHEARSED_ITERATIONS), "--time-limit", "2", "--inject-throttling", "0.3",
         "--fault-seed", "1"]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    throttled = re.search(r"rehearsal: (\d+) Lambda invocation\(s\) \((\d+) throttled\)", out)
    assert throttled is not None and int(throttled[2]) >= 1, out
    driver = re.search(r"rehearsal: (\d+) of the driver's Step Functions requests were throttled", out)
    assert driver is not None and int(driver[1]) >= 1, out  # botocore's retries met them
    assert json.loads((tmp_path / "metrics.json").read_text())["status"] == "done"
    assert_same(load_file(tmp_path / "model.safetensors"), sample_undisturbed)


@pytest.mark.slow
def test_invokes_throttled_to_the_end_end_the_run_within_the_retries_with_one_line(
    sample_build: Path, tmp_path: Path, aws_env: None, capsys
) -> None:
    """Every invoke throttled: the state machine's Retry (6 tries over ~2 min) gives up, its Map fails at once
    (the other workers are not waited for: they wait for keys the throttled one never writes), and with
    --retries 0 the run ends: one line naming Lambda's error; no hang."""
    took, last = failed_rehearsal(sample_build, tmp_path, capsys, "--inject-throttling", "1", "--retries", "0")
    assert "TooManyRequestsException" in last
    assert took < 126 + 120, took  # the Retry's waits, and the rehearsal's deploy and teardown


def failed_rehearsal(build: Path, tmp_path: Path, capsys: Any, *options: str) -> tuple[float, str]:
    """A Lambda rehearsal of `build` that must fail: (its seconds, its last line, which says why in one line)."""
    began = time.monotonic()
    argv = [str(build), "--out", str(tmp_path / "out"), "--model", str(MLP), "-q", "--no-verify-build"]
    code = run_main([*argv, "--invoker", "lambda", "--rehearse", *options])
    took = time.monotonic() - began
    err = capsys.readouterr().err.strip()
    assert code == 1 and "Traceback" not in err, err
    last = err.splitlines()[-1]
    assert last.startswith("cloudless-run: the run failed: "), err
    return took, last


@pytest.mark.slow
def test_every_invocation_timing_out_ends_the_run_within_the_retries_with_one_line(
    sample_build: Path, tmp_path: Path, aws_env: None, capsys
) -> None:
    """Stage 1's Lambda timeout lowered to 2 s under the build (as an operator might, after the deploy): every
    invocation of it times out (Sandbox.Timedout, which the state machine does not retry), the execution
    fails at once, the next attempt too, and with --retries 1 the run ends: one line naming Lambda's error
    and the attempts; no hang."""
    import shutil

    build = tmp_path / "build"
    shutil.copytree(sample_build, build)
    template = build / "regions" / "aws-us-east-1" / "template.yaml"
    text = template.read_text()
    at = text.rindex("Timeout: 900")  # the last function's (stage 1)
    template.write_text(text[:at] + "Timeout: 2" + text[at + len("Timeout: 900") :])
    took, last = failed_rehearsal(build, tmp_path, capsys, "--retries", "1", "--iterations", "100")
    assert "Sandbox.Timedout" in last and "Task timed out after 2.00 seconds (attempt 2 of 2)" in last, last
    assert took < 180, took  # two attempts of seconds each, and the rehearsal's deploy and teardown


@pytest.mark.slow
def test_the_fault_bench_runs_and_every_faulted_run_trains_the_undisturbed_model() -> None:
    """bench/fault_bench.py --quick, as CI runs it (a bench no test runs rots)."""
    import sys

    bench = Path(__file__).resolve().parent.parent / "bench" / "fault_bench.py"
    finished = subprocess.run([sys.executable, str(bench), "--quick"], capture_output=True, text=True, timeout=900)
    assert finished.returncode == 0, finished.stderr[-2000:]
    rows = [line for line in finished.stdout.splitlines() if line.startswith("local, ")]
    assert len(rows) >= 4 and all(line.endswith("identical") for line in rows), finished.stdout
