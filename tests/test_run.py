"""`cloudless-run`: the controller invokes the generated packages as local processes, and training is
exactly what plain PyTorch computes — with invocations cut short by a time limit, with injected
faults, and with duplicate invocations."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from cloudless.ir.workflow import Workflow
from cloudless.runtimes.cli import main as run_main
from cloudless.runtimes.function.worker import StageWorker
from cloudless.runtimes.storage.channels import DirectoryChannel
from tests.runtime_cases import MLP, front_end, reference_training, write_packages, write_training_data

ITERATIONS = 6


@pytest.fixture(scope="module")
def pipelined(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Workflow, dict[str, torch.Tensor]]:
    """A 3-stage build of the MLP with replicas (2, 3, 1), and what plain PyTorch trains."""
    result = front_end()
    n_blocks = len(result.chain.blocks)
    stages = [(0, 0, 2), (1, n_blocks - 2, 3), (n_blocks - 1, n_blocks - 1, 1)]
    build = tmp_path_factory.mktemp("pipelined") / "build"
    workflow = write_packages(
        result, build, stages, micro_batch=8, global_batch=64, iterations=ITERATIONS, schedule="1f1b"
    )
    return build, workflow, reference_training(result, workflow, workflow.regions[0].name)


def cloudless_run(build: Path, out: Path, *options: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    code = run_main([str(build), "--out", str(out), "--model", str(MLP), "-q", *options])
    assert code == 0
    return json.loads((out / "metrics.json").read_text()), load_file(out / "model.safetensors")


@pytest.fixture(scope="module")
def baseline(pipelined, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    build, _, _ = pipelined
    return cloudless_run(build, tmp_path_factory.mktemp("baseline"))


def assert_same(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(expected)
    for name, value in expected.items():
        assert torch.equal(got[name], value), name


@pytest.mark.slow
def test_pipelined_replicated_run_matches_plain_pytorch(pipelined, baseline) -> None:
    build, workflow, expected = pipelined
    metrics, params = baseline
    assert set(params) == set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-6, msg=name)
    assert [p["iteration"] for p in metrics["progress"]] == list(range(ITERATIONS))
    assert all(0 < p["loss"] < 5 for p in metrics["progress"])
    assert metrics["invocations"] == 2 + 3 + 1 and metrics["retries"] == 0
    # Every replica of the middle stage fetched activations and gradients and joined the sync.
    assert metrics["storage_requests"]["mlp-digits-s1"]["gets"] > 3 * ITERATIONS * 2
    assert not (build / "run").exists()  # --out was given: nothing written into the build


@pytest.mark.slow
def test_time_limit_ends_invocations_early_and_changes_nothing(pipelined, baseline, tmp_path: Path) -> None:
    build, _, _ = pipelined
    metrics, params = cloudless_run(build, tmp_path, "--time-limit", "0.2")
    # The workers stopped where they all agreed, and the controller invoked the rest again.
    assert metrics["invocations"] > 6 and metrics["retries"] == 0
    starts = sorted({i["start"] for i in metrics["invocation_log"]})
    assert starts[0] == 0 and len(starts) > 1
    assert_same(params, baseline[1])


@pytest.mark.slow
def test_injected_faults_change_nothing(pipelined, baseline, tmp_path: Path) -> None:
    build, _, _ = pipelined
    metrics, params = cloudless_run(build, tmp_path, "--inject-faults", "0.5", "--fault-seed", "3")
    assert metrics["faults_injected"] >= 1 and metrics["retries"] >= metrics["faults_injected"]
    assert any(i["status"] == "failed" for i in metrics["invocation_log"])
    assert_same(params, baseline[1])
    trace = json.loads((tmp_path / "trace.json").read_text())
    names = {e["name"] for e in trace["traceEvents"]}
    assert {"sync", "step", "forward 0", "backward 0"} <= names
    assert any("failed" in n for n in names)


def test_duplicate_invocations_change_nothing(tmp_path: Path) -> None:
    result = front_end()
    n_blocks = len(result.chain.blocks)
    workflow = write_packages(
        result, tmp_path / "build", [(0, n_blocks - 1, 1)], micro_batch=8, global_batch=16, iterations=2
    )
    region = workflow.regions[0]
    storage = tmp_path / "storage"
    write_training_data(result, DirectoryChannel(storage), region.name)
    package = tmp_path / "build" / region.functions[0].package

    first = StageWorker(package, DirectoryChannel(storage)).run(0, 2, 0, run="r", attempt=0)
    state = (storage / "r" / region.name / "state" / "s0" / "it2").read_bytes()
    # The same attempt delivered again (a platform's at-least-once delivery) while it ran: claimed.
    again = StageWorker(package, DirectoryChannel(storage))
    (storage / "r" / region.name / "done" / "mlp-digits-s0" / "r0" / "from0").unlink()
    # ... whose own result never comes (it died): nothing of the range is known done, not "stopped at 0"
    lost = again.run(0, 2, 0, run="r", attempt=0, timeout=1)
    assert (lost.status, lost.stop) == ("duplicate", 0)
    # A retry (a new attempt): it resumes from the last checkpoint and recomputes the same bytes.
    retried = again.run(0, 2, 0, run="r", attempt=1)
    assert retried.stop == 2 and retried.resumed == 1
    assert retried.losses == first.losses[-len(retried.losses) :]
    assert (storage / "r" / region.name / "state" / "s0" / "it2").read_bytes() == state
    # After it finished, any further copy returns the recorded result and runs nothing.
    repeat = StageWorker(package, DirectoryChannel(storage)).run(0, 2, 0, run="r", attempt=2)
    assert repeat.duplicate is True and repeat.losses == retried.losses
    # A copy delivered while the original runs answers with the original's result once it is there: where
    # it really stopped (Step Functions starts the next range at the workers' stop).
    with ThreadPoolExecutor(2) as pool:
        original = pool.submit(StageWorker(package, DirectoryChannel(storage)).run, 0, 2, 0, run="s", attempt=0)
        claim = storage / "s" / region.name / "claim"
        while not original.done() and not any(p.is_file() for p in claim.rglob("*")):
            time.sleep(0.01)
        copy = pool.submit(StageWorker(package, DirectoryChannel(storage)).run, 0, 2, 0, run="s", attempt=0)
        assert (copy.result().stop, copy.result().duplicate) == (original.result().stop, True) == (2, True)


def test_short_invocations_leave_no_range_end_checkpoints_behind(tmp_path: Path) -> None:
    """Invocations cut short (time limits) each end with a checkpoint that is not a multiple of
    checkpoint_every; once a later invocation has started past it, nobody resumes from it: deleted,
    so storage holds the last two regular checkpoints and the last invocation's start only."""
    result = front_end()
    n_blocks = len(result.chain.blocks)
    workflow = write_packages(
        result, tmp_path / "build", [(0, n_blocks - 1, 1)], micro_batch=8, global_batch=16, iterations=6
    )
    region = workflow.regions[0]
    assert workflow.run.checkpoint_every == 2
    storage = tmp_path / "storage"
    write_training_data(result, DirectoryChannel(storage), region.name)
    package = tmp_path / "build" / region.functions[0].package
    for start, stop in ((0, 3), (3, 5), (5, 6)):
        done = StageWorker(package, DirectoryChannel(storage)).run(start, stop, 0, run="r", attempt=0)
        assert (done.status, done.stop) == ("done", stop)
    states = sorted(p.name for p in (storage / "r" / region.name / "state" / "s0").glob("it*"))
    assert states == ["it4", "it5", "it6"]
    # a retry of the last range resumes from the recorded newest checkpoint in its range
    assert StageWorker(package, DirectoryChannel(storage)).run(5, 6, 0, run="r", attempt=1).resumed == 5


@pytest.mark.slow
def test_a_model_that_raises_stops_the_run_at_once_without_retries(
    pipelined, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Stage 1's forward raises at iteration 2: no retry (the model computes the same thing again);
    the function writes the abort record, its neighbours stop waiting, and the run ends within
    seconds with one line naming the iteration, stage, function, replica, exception and line."""
    import shutil

    build = tmp_path / "build"
    shutil.copytree(pipelined[0], build)
    (stage_py,) = build.glob("regions/*/functions/*-s1/stage.py")
    source = stage_py.read_text()
    head, signature, rest = source.partition("    def forward(self")
    line = signature + rest.split("\n", 1)[0]
    failing = (
        f"{line}\n"
        "        import os\n"
        "        calls = int(os.environ.get('CLOUDLESS_TEST_CALLS', '0')) + 1\n"
        "        os.environ['CLOUDLESS_TEST_CALLS'] = str(calls)\n"
        "        if calls > 2 * 8 // 3 + 2:  # past the first two iterations' micro-batches\n"
        "            raise ValueError('boom: the model cannot take this batch')\n"
    )
    stage_py.write_text(head + failing + rest.split("\n", 1)[1])
    began = time.monotonic()
    # the stage.py edited here is not what the compile wrote: run it anyway
    argv = [str(build), "--out", str(tmp_path / "out"), "--model", str(MLP), "-q", "--key-timeout", "600"]
    code = run_main([*argv, "--no-verify-build"])
    took = time.monotonic() - began
    err = capsys.readouterr().err
    assert code == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("cloudless-run: the run failed: iteration "), err
    assert (
        "the forward of stage 1 (" in lines[0]
        and "raised ValueError: boom: the model cannot take this batch" in lines[0]
    )
    assert "(at stage.py:" in lines[0], err
    # a run that waited for the failed stage's keys would take the 600 s key timeout
    assert took < 300, f"the run took {took:.0f} s to stop"
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert metrics["status"] == "failed" and metrics["retries"] == 0, metrics
    assert metrics["invoker"] == "local" and lines[0] == f"cloudless-run: the run failed: {metrics['error']}"


def test_bad_input_is_one_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str], pipelined) -> None:
    assert run_main([str(tmp_path)]) == 2
    assert f"{tmp_path}/workflow.yaml: not found" in capsys.readouterr().err
    (tmp_path / "README.md").write_text("# not a build\n")
    assert run_main([str(tmp_path / "README.md")]) == 2  # a file, not a folder: one line too
    assert capsys.readouterr().err.strip() == (
        f"cloudless-run: {tmp_path}/README.md/workflow.yaml: not found; expected a build folder written by "
        "cloudless-compile"
    )
    build, _, _ = pipelined
    missing = tmp_path / "nowhere.py"
    assert run_main([str(build), "--out", str(tmp_path / "out"), "--model", str(missing)]) == 2
    assert f"{missing}: no such model file" in capsys.readouterr().err
    assert run_main([str(build), "--out", str(tmp_path / "out"), "--inject-faults", "1.5"]) == 2
    assert "--inject-faults 1.5: expected a share in [0, 1)" in capsys.readouterr().err
    # 0 and negatives are errors where they mean nothing (0 iterations used to train the default 200)
    for option, value, expected in (
        ("--iterations", "0", "--iterations 0: expected at least 1"),
        ("--retries", "-1", "--retries -1: expected at least 0"),
        ("--time-limit", "-5", "--time-limit -5.0: expected a positive number of seconds"),
        ("--key-timeout", "nan", "--key-timeout nan: expected a positive number of seconds"),
        (
            "--bandwidth",
            "0",
            "--bandwidth 0.0: expected megabytes per second from 0.001 to 1e+06 (1 kB/s to 1 TB/s: any real "
            "network's is within)",
        ),
        (
            "--latency-ms",
            "-1",
            "--latency-ms -1.0: expected milliseconds from 0 to 600000 (10 minutes: any real network's is within)",
        ),
        ("--run-id", "data", "--run-id: expected a name without '/' or '..', other than '.' and 'data', got 'data'"),
    ):
        assert run_main([str(build), "--out", str(tmp_path / "out"), option, value]) == 2
        err = capsys.readouterr().err
        assert err.strip() == f"cloudless-run: {expected}", err


@pytest.mark.slow
def test_compiled_sample_trains_to_90_percent(compile_cli, tmp_path: Path, capsys) -> None:
    """The README's main command: compile the digits sample, run it, read the test accuracy."""
    build = tmp_path / "build"
    code, _, err = compile_cli(str(MLP), "-o", str(build), "-q", "--repeats", "1")
    assert code == 0, err
    assert run_main([str(build), "--out", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["iterations"] == 200
    assert metrics["test"]["accuracy"] >= 0.90, out
    assert f"accuracy {metrics['test']['accuracy']:.1%}" in out
    assert metrics["progress"][-1]["loss"] < metrics["progress"][0]["loss"]


def _function_processes(build: Path) -> list[str]:
    """Command lines of live processes running one of the build's handlers."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(build) in command and "handler.py" in command:
            found.append(command)
    return found


@pytest.fixture(scope="module")
def mlp_build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The digits sample compiled as the README does (one function)."""
    from cloudless.compiler.cli import main as compile_main

    build = tmp_path_factory.mktemp("mlp") / "build"
    assert compile_main([str(MLP), "-o", str(build), "-q", "--repeats", "1"]) == 0
    return build.resolve()


#: the key timeout of the runs started by _start_run
KEY_TIMEOUT_S = 600


def _start_run(build: Path, out: Path, *options: str) -> subprocess.Popen[str]:
    """`cloudless-run` in its own process, once its function trains (it printed an iteration)."""
    # The key timeout is explicit: a run that waits for keys that never come takes it; one that ends
    # as it should takes a small part of it, however loaded the machine.
    command = [sys.executable, "-m", "cloudless.runtimes.cli", str(build), "--out", str(out), "--log-every", "1"]
    command += ["--key-timeout", str(KEY_TIMEOUT_S)]
    process = subprocess.Popen([*command, *options], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert process.stdout is not None
    for line in process.stdout:
        if line.startswith("iteration"):
            return process
    raise AssertionError(f"it never trained: {process.communicate()}")


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc to find the function processes")
def test_ctrl_c_and_a_killed_controller_leave_no_function_running(mlp_build: Path, tmp_path: Path) -> None:
    """Ctrl-C: exit 130, one line, every function process stopped. SIGKILL of the controller: its
    function processes die with it (no orphans)."""
    build = mlp_build
    for sent in (signal.SIGINT, signal.SIGKILL):
        process = _start_run(build, tmp_path / f"run-{sent.name}", "--iterations", "1000000")
        assert _function_processes(build), "no function process was found while training"
        process.send_signal(sent)
        try:
            _, err = process.communicate(timeout=30)
        finally:
            process.kill()
        if sent == signal.SIGINT:
            assert process.returncode == 130
            assert err.strip().splitlines() == ["cloudless-run: interrupted; the run's functions were stopped"], err
        deadline = time.monotonic() + 10
        while _function_processes(build) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _function_processes(build) == [], f"after {sent.name}: function processes outlived the run"


@pytest.mark.slow
def test_a_killed_run_resumes_to_the_same_parameters(mlp_build: Path, tmp_path: Path, capsys) -> None:
    """SIGKILL of the controller past a checkpoint, then --resume: the same model, bit for bit, as a
    run that was never interrupted."""
    iterations = "120"  # checkpoints every 50: the kill lands past the first
    assert run_main([str(mlp_build), "--out", str(tmp_path / "whole"), "--iterations", iterations, "-q"]) == 0
    out = tmp_path / "killed"
    process = _start_run(mlp_build, out, "--iterations", iterations, "--run-id", "k")
    assert process.stdout is not None
    for line in process.stdout:
        if int(line.split()[1].split("/")[0]) >= 70:
            break
    process.kill()
    process.communicate(timeout=30)
    capsys.readouterr()
    assert run_main([str(mlp_build), "--out", str(out), "--iterations", iterations, "--resume", "k", "-q"]) == 0
    assert "resuming run k from iteration 50" in capsys.readouterr().out
    whole, resumed = load_file(tmp_path / "whole" / "model.safetensors"), load_file(out / "model.safetensors")
    assert whole.keys() == resumed.keys()
    assert all(torch.equal(whole[name], resumed[name]) for name in whole)
    # Nothing to resume is one line.
    assert run_main([str(mlp_build), "--out", str(out), "--resume", "nothing"]) == 2
    assert "--resume nothing: " in capsys.readouterr().err


def _run_on_redis_then(mlp_build: Path, tmp_path: Path, disturb: str) -> tuple[int, str, float]:
    """A long run on a Redis of its own; once it trains, `disturb` it ("stop" the server, or "flush"
    its keys): the run's exit status, its stderr and how long it took to end after that."""
    import redis

    from tests.conftest import _stop, private_redis

    server, port, _ = private_redis(tmp_path)
    try:
        process = _start_run(
            mlp_build, tmp_path / "out", "--iterations", "1000000", "--storage", f"redis://127.0.0.1:{port}/0"
        )
        if disturb == "stop":
            _stop(server)
        else:
            redis.Redis(port=port).flushall()
        began = time.monotonic()
        _, err = process.communicate(timeout=KEY_TIMEOUT_S)
        took = time.monotonic() - began
    finally:
        _stop(server)
        if process.poll() is None:
            process.kill()
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert _function_processes(mlp_build) == []
    return process.returncode, err.strip(), took


@pytest.mark.slow
def test_storage_that_stops_answering_ends_the_run_with_one_line(mlp_build: Path, tmp_path: Path) -> None:
    """Redis stopped mid-run: the controller retries with back-off, then the run ends (exit 1, one
    line naming the storage and the error) within a minute, its functions stopped, no traceback."""
    code, err, took = _run_on_redis_then(mlp_build, tmp_path, "stop")
    assert code == 1 and took < KEY_TIMEOUT_S / 2
    assert err.startswith("cloudless-run: the run failed: storage failed (reading redis "), err
    assert "ConnectionError: Error 111 connecting to 127.0.0.1:" in err, err


def test_a_storage_password_is_never_printed() -> None:
    from cloudless.runtimes.control.storage_locations import shown

    assert shown("redis://:s3cret@127.0.0.1:6379/0") == "redis://:***@127.0.0.1:6379/0"
    assert shown("redis://user:s3cret@cache.internal/2#runs") == "redis://user:***@cache.internal/2#runs"
    assert shown("s3://bucket/prefix") == "s3://bucket/prefix" and shown("/tmp/storage") == "/tmp/storage"


@pytest.mark.slow
def test_storage_that_lost_the_runs_keys_ends_the_run_with_one_line(mlp_build: Path, tmp_path: Path) -> None:
    """Redis flushed mid-run (FLUSHALL, eviction): the controller sees its alive key gone and ends
    the run within seconds (exit 1, one line), instead of functions waiting for keys that are gone."""
    code, err, took = _run_on_redis_then(mlp_build, tmp_path, "flush")
    assert code == 1 and took < KEY_TIMEOUT_S / 2
    assert err.startswith("cloudless-run: the run failed: storage lost the run's keys near iteration "), err


@pytest.mark.slow
def test_a_full_disk_ends_the_run_with_one_line(mlp_build: Path, tmp_path: Path) -> None:
    """The storage folder's file system fills up mid-run (a small tmpfs): the function's writes fail,
    the controller's too, and the run ends within a minute (exit 1, one line naming the error)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    process = None
    try:
        process = _start_run(mlp_build, tmp_path / "out", "--iterations", "1000000", "--storage", str(disk / "store"))
        # Filled to the last byte: the run writes meanwhile, so a size read first may no longer fit.
        with open(disk / "filler", "wb", buffering=0) as filler:
            with contextlib.suppress(OSError):  # ENOSPC: full
                while True:
                    filler.write(bytes(1 << 16))
        assert os.statvfs(disk).f_bavail == 0
        began = time.monotonic()
        _, err = process.communicate(timeout=KEY_TIMEOUT_S)
        assert time.monotonic() - began < KEY_TIMEOUT_S / 2
    finally:
        if process is not None and process.poll() is None:
            process.kill()
            process.communicate()
        subprocess.run(["umount", str(disk)], check=False)
    assert process.returncode == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("cloudless-run: the run failed: "), err
    assert "No space left on device" in lines[0], err
    assert _function_processes(mlp_build) == []


# --- issue 32: --storage guarded, the build's digests checked, emulation figures in range -----------------


@pytest.fixture(scope="module")
def one_stage(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Workflow, Any]:
    """The MLP as one function for 2 iterations (a run takes a few seconds), as a compile writes it
    (cloudless-build.json included); the front end's result alongside."""
    result = front_end()
    n_blocks = len(result.chain.blocks)
    build = tmp_path_factory.mktemp("one_stage") / "build"
    workflow = write_packages(result, build, [(0, n_blocks - 1, 1)], micro_batch=8, global_batch=16, iterations=2)
    return build, workflow, result


def _one_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_a_storage_folder_of_the_users_is_refused_and_nothing_is_written(
    one_stage, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """--storage gets -o/--out's protection: a folder holding files Cloudless did not write, the current
    folder, one holding the build, '' and a file are each one line (exit 2), before anything is written."""
    build, _, _ = one_stage
    mine = tmp_path / "mine"
    (mine / "run" / "aws-us-east-1").mkdir(parents=True)
    (mine / "run" / "aws-us-east-1" / "notes.txt").write_text("my notes\n")
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder\n")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    out = tmp_path / "out"
    for storage, expected in (
        (
            str(mine),
            f"--storage {mine}: holds files Cloudless did not write; expected a new or empty folder, or one an "
            "earlier run used",
        ),
        ("", "--storage '': empty; expected a folder, s3://bucket/prefix or redis://host:port/db"),
        (".", "--storage .: is the current folder; choose a new folder inside it"),
        (str(tmp_path), f"--storage {tmp_path}: contains the current folder; choose a new folder"),
        (
            str(build),
            f"--storage {build}: holds {build / 'workflow.yaml'}, an input of this command; choose a new folder",
        ),
        (
            str(a_file),
            f"--storage {a_file}: is a file; expected a folder (a new one, an empty one, or one an earlier run used)",
        ),
        (f"{a_file}/storage", f"--storage {a_file}/storage: {a_file} is a file; expected a folder"),
    ):
        code = run_main([str(build), "--out", str(out), "--model", str(MLP), "-q", "--storage", storage])
        assert (code, _one_line(capsys)) == (2, f"cloudless-run: {expected}"), storage
        assert not out.exists(), storage  # nothing half-written: not even the run's output folder
    assert (mine / "run" / "aws-us-east-1" / "notes.txt").read_text() == "my notes\n"
    assert sorted(p.name for p in work.iterdir()) == []


@pytest.mark.skipif(not Path("/sys/kernel").is_dir(), reason="needs /sys, where nobody may make a folder")
def test_a_storage_folder_that_cannot_be_written_is_one_line(one_stage, tmp_path: Path, capsys) -> None:
    build, _, _ = one_stage
    storage = Path("/sys/cloudless-storage-test")
    out = tmp_path / "out"
    assert run_main([str(build), "--out", str(out), "--model", str(MLP), "-q", "--storage", str(storage)]) == 2
    assert _one_line(capsys).startswith(f"cloudless-run: --storage {storage}: cannot be written: ")
    assert not out.exists() and not storage.exists()


def test_the_clean_up_deletes_only_the_keys_the_run_wrote(one_stage, tmp_path: Path, capsys) -> None:
    """A storage folder an earlier run used (the staged data), with files of the user's inside the run's
    own namespace: the run's end deletes its keys and keeps every one of the user's files."""
    build, workflow, result = one_stage
    region = workflow.regions[0].name
    storage = tmp_path / "storage"
    write_training_data(result, DirectoryChannel(storage), region)  # as a run stages it: the folder is marked
    namespace = storage / "mine" / region
    notes = [namespace / "notes.txt", namespace / "state" / "notes.txt"]
    for note in notes:
        note.parent.mkdir(parents=True, exist_ok=True)
        note.write_text("my notes\n")
    argv = [str(build), "--out", str(tmp_path / "out"), "--model", str(MLP), "-q"]
    assert run_main([*argv, "--storage", str(storage), "--run-id", "mine"]) == 0, capsys.readouterr().err
    assert all(note.read_text() == "my notes\n" for note in notes)
    assert sorted(p for p in namespace.rglob("*") if p.is_file()) == sorted(notes)  # the run's keys: gone
    assert any((storage / "data").rglob("*"))  # the staged data stays for the next run


def _listed(build: Path, suffix: str) -> Path:
    from cloudless.ir.files import read_manifest

    (path,) = [build / p for p in read_manifest(build) or {} if p.endswith(suffix)]
    return path


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) - 5] ^= 0x01
    path.write_bytes(bytes(data))


def _edit_micro_batch(path: Path) -> None:
    spec = json.loads(path.read_text())
    spec["workflow"]["run"]["micro_batch"] *= 2
    path.write_text(json.dumps(spec, indent=1, sort_keys=True))


@pytest.mark.parametrize(
    ("suffix", "damage", "what"),
    [
        ("/weights.safetensors", _flip_a_byte, "differs from what cloudless-compile wrote"),
        ("/function.json", _edit_micro_batch, "differs from what cloudless-compile wrote"),
        ("/stage.py", lambda p: p.write_text(p.read_text() + "\nimport os\nos.system('true')\n"), "differs from"),
        ("/handler.py", lambda p: p.unlink(), "is missing"),
    ],
    ids=["weights-bit-flipped", "micro-batch-edited", "code-appended", "file-deleted"],
)
def test_an_edited_build_is_refused_before_anything_runs(
    one_stage, tmp_path: Path, capsys, suffix: str, damage: Callable[[Path], None], what: str
) -> None:
    import shutil

    build = tmp_path / "build"
    shutil.copytree(one_stage[0], build)
    path = _listed(build, suffix)
    damage(path)
    out = tmp_path / "out"
    assert run_main([str(build), "--out", str(out), "--model", str(MLP), "-q"]) == 2
    line = _one_line(capsys)
    relative = path.relative_to(build).as_posix()
    assert line.startswith(f"cloudless-run: {build}: {relative} {what}"), line
    assert line.endswith("; recompile, or pass --no-verify-build to run it anyway"), line
    assert not out.exists()  # before staging data, before any invocation


def test_a_build_without_its_manifest_is_refused(one_stage, tmp_path: Path, capsys) -> None:
    import shutil

    build = tmp_path / "build"
    shutil.copytree(one_stage[0], build)
    (build / "cloudless-build.json").unlink()
    assert run_main([str(build), "--out", str(tmp_path / "out"), "--model", str(MLP), "-q"]) == 2
    assert _one_line(capsys) == (
        f"cloudless-run: {build}: no cloudless-build.json (the digests of what cloudless-compile wrote); "
        "recompile, or pass --no-verify-build to run it anyway"
    )
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_files_a_run_writes_into_the_build_are_not_flagged(one_stage, tmp_path: Path, capsys) -> None:
    """A run's output inside the build (BUILD/run, its logs) is not the compile's: the next run of the
    build gets past the check (here to --resume's own refusal: nothing to resume)."""
    import shutil

    build = tmp_path / "build"
    shutil.copytree(one_stage[0], build)
    assert run_main([str(build), "--model", str(MLP), "-q"]) == 0, capsys.readouterr().err
    assert (build / "run" / "metrics.json").is_file() and any((build / "run" / "logs").rglob("*.log"))
    capsys.readouterr()
    assert run_main([str(build), "--model", str(MLP), "-q", "--resume", "nothing"]) == 2
    assert "--resume nothing: " in _one_line(capsys)


def test_no_verify_build_runs_a_build_edited_by_hand(one_stage, tmp_path: Path, capsys) -> None:
    import shutil

    build = tmp_path / "build"
    shutil.copytree(one_stage[0], build)
    stage_py = _listed(build, "/stage.py")
    stage_py.write_text(stage_py.read_text() + "\n# edited by hand\n")
    argv = [str(build), "--out", str(tmp_path / "out"), "--model", str(MLP), "-q"]
    assert run_main(argv) == 2
    assert "stage.py differs from what cloudless-compile wrote" in _one_line(capsys)
    assert run_main([*argv, "--no-verify-build"]) == 0, capsys.readouterr().err
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_emulation_figures_beyond_physical_bounds_are_one_line(one_stage, tmp_path: Path, capsys) -> None:
    """--bandwidth 1e-300 or --latency-ms 1e100 used to overflow inside every function: refused up front."""
    build, _, _ = one_stage
    bandwidth = "expected megabytes per second from 0.001 to 1e+06 (1 kB/s to 1 TB/s: any real network's is within)"
    latency = "expected milliseconds from 0 to 600000 (10 minutes: any real network's is within)"
    for option, value, expected in (
        ("--bandwidth", "1e-300", f"--bandwidth 1e-300: {bandwidth}"),
        ("--bandwidth", "0.0009", f"--bandwidth 0.0009: {bandwidth}"),
        ("--bandwidth", "2e6", f"--bandwidth 2000000.0: {bandwidth}"),
        ("--bandwidth", "inf", f"--bandwidth inf: {bandwidth}"),
        ("--bandwidth", "-3", f"--bandwidth -3.0: {bandwidth}"),
        ("--latency-ms", "1e100", f"--latency-ms 1e+100: {latency}"),
        ("--latency-ms", "600001", f"--latency-ms 600001.0: {latency}"),
        ("--latency-ms", "nan", f"--latency-ms nan: {latency}"),
        ("--latency-ms", "-1", f"--latency-ms -1.0: {latency}"),
    ):
        out = tmp_path / "out"
        assert run_main([str(build), "--out", str(out), "--model", str(MLP), option, value]) == 2
        assert _one_line(capsys) == f"cloudless-run: {expected}", (option, value)
        assert not out.exists()
