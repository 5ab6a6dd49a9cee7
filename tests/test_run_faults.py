"""A pipelined, replicated run (3 stages, replicas 2+3+1) when something goes wrong in its middle, run as
a user runs it (cloudless-run in a process of its own).

Storage that refuses writes: a real folder on a size-limited tmpfs that fills up, a real redis-server
that reaches its memory limit. The function whose write fails stops the run: the controller exits 1
within seconds with one line naming the storage error (not a key timeout after 600 s per attempt), and
the run's keys stay for --resume. A controller paused mid-run (SIGSTOP) catches up at once when it goes
on, with honest figures."""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cloudless.ir.folders import RUN_LOCK
from tests.conftest import _stop, private_redis
from tests.runtime_cases import MLP, front_end, write_packages

# each compiles a pipeline and trains it for a while in processes of its own
pytestmark = pytest.mark.slow

#: long enough that the run is still going when storage fills up
ITERATIONS = 400
#: a run still going this long after its storage filled up hangs (the key timeout is 600 s per attempt);
#: it ends in about 2 s
HANG_S = 120


@pytest.fixture(scope="module")
def long_pipeline(tmp_path_factory: pytest.TempPathFactory) -> Path:
    result = front_end()
    n_blocks = len(result.chain.blocks)
    stages = [(0, 0, 2), (1, n_blocks - 2, 3), (n_blocks - 1, n_blocks - 1, 1)]
    build = tmp_path_factory.mktemp("long_pipeline") / "build"
    write_packages(result, build, stages, micro_batch=8, global_batch=64, iterations=ITERATIONS, schedule="1f1b")
    return build


def run_until_storage_fails(build: Path, out: Path, storage: str, fill: Callable[[], None]) -> tuple[int, str]:
    """Start cloudless-run, let it train a few iterations, `fill()` its storage; (exit code, stderr)."""
    return run_and_meddle(build, out, ["--storage", storage, "--run-id", "full"], lambda _: fill())


def run_and_meddle(
    build: Path, out: Path, options: list[str], meddle: Callable[[subprocess.Popen[str]], None]
) -> tuple[int, str]:
    """Start cloudless-run, let it train a few iterations, `meddle` with it; (exit code, stderr)."""
    command = [sys.executable, "-m", "cloudless.runtimes.cli", str(build), "--out", str(out), "--model", str(MLP)]
    command += [*options, "--log-every", "1", "--no-verify-build"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        for line in process.stdout:
            if line.lstrip().startswith("iteration") and int(line.split()[1].split("/")[0]) >= 3:
                break
        else:
            pytest.fail(f"the run ended before it trained 3 iterations: {process.wait()} {process.stderr.read()}")
        meddle(process)
        try:
            _, stderr = process.communicate(timeout=HANG_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the run was still going {HANG_S} s after it was meddled with")
        return process.returncode, stderr
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def assert_stopped_by(code: int, stderr: str, out: Path, cause: str) -> None:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert code == 1, stderr
    assert lines[-1].startswith("cloudless-run: the run failed: "), stderr
    # a function's write, or (when it comes first) one of the controller's own: either way the cause
    assert ("storage refused a write" in lines[-1] or "storage failed" in lines[-1]) and cause in lines[-1], lines[-1]
    assert "did not appear within" not in stderr  # the cause, not a key timeout
    assert "; to continue it: cloudless-run " in lines[-1] and " --resume " in lines[-1], lines[-1]  # how to go on
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["status"] == "failed" and cause in metrics["error"]


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 64 MiB tmpfs (a real size-limited folder); skipped where this process may not mount one."""
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    if shutil.which("mount") is None or os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mount)], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_folder_mid_run_stops_the_run_with_its_cause(long_pipeline: Path, small_tmpfs: Path, tmp_path):
    def fill() -> None:  # what is left of the 64 MiB, taken by a file of the user's
        with (small_tmpfs / "filler").open("wb") as filler:
            try:
                while True:
                    filler.write(b"\0" * 2**20)
                    filler.flush()
            except OSError:
                pass

    code, stderr = run_until_storage_fails(long_pipeline, tmp_path / "out", str(small_tmpfs), fill)
    assert_stopped_by(code, stderr, tmp_path / "out", "No space left on device")
    assert any((small_tmpfs / "full").rglob("*")), "the run's keys were deleted: --resume has nothing to go on"


def test_a_folder_made_read_only_mid_run_stops_the_run_with_its_cause(
    long_pipeline: Path, small_tmpfs: Path, tmp_path: Path
) -> None:
    def read_only() -> None:  # root writes through file modes: the mount itself goes read-only
        subprocess.run(["mount", "-o", "remount,ro", str(small_tmpfs)], check=True)

    code, stderr = run_until_storage_fails(long_pipeline, tmp_path / "out", str(small_tmpfs), read_only)
    assert_stopped_by(code, stderr, tmp_path / "out", "Read-only file system")


def test_redis_at_its_memory_limit_mid_run_stops_the_run_with_its_cause(long_pipeline: Path, tmp_path: Path):
    import redis

    process, port, _ = private_redis(tmp_path)
    client = redis.Redis(host="127.0.0.1", port=port)
    try:
        client.config_set("maxmemory-policy", "noeviction")

        def fill() -> None:  # the limit below what it holds: every write that needs memory is refused
            client.config_set("maxmemory", 1)

        url = f"redis://127.0.0.1:{port}/0"
        code, stderr = run_until_storage_fails(long_pipeline, tmp_path / "out", url, fill)
        refused = "OutOfMemoryError: command not allowed when used memory"
        assert_stopped_by(code, stderr, tmp_path / "out", refused)
        assert client.keys("full/*"), "the run's keys were deleted: --resume has nothing to go on"
    finally:
        client.close()
        _stop(process)


def test_a_controller_paused_mid_run_catches_up_at_once(long_pipeline: Path, tmp_path: Path) -> None:
    """The functions go on while the controller is stopped (SIGSTOP), and sweep the progress reports it
    did not read: it rebuilds them from the invocations' results instead of waiting 2 s for each, and
    the throughput it prints is measured, not divided by the rebuilt reports' zero steps."""

    storage = tmp_path / "storage"

    def checkpointed() -> int:
        """The newest checkpoint every stage's record names (its `latest_state_key`), 0 before one."""
        newest = []
        for record in storage.rglob("state/s*/latest"):
            try:
                newest.append(int(json.loads(record.read_text())["latest"]))
            except (OSError, ValueError, KeyError):
                newest.append(0)  # being written
        return min(newest, default=0)

    def pause(process: subprocess.Popen[str]) -> None:
        os.kill(process.pid, signal.SIGSTOP)
        # Until the functions pass two checkpoints (every 100 iterations) without it, however long a
        # loaded machine takes; they sweep the reports it has not read.
        began = checkpointed()
        deadline = time.monotonic() + HANG_S
        while checkpointed() < began + 200 and time.monotonic() < deadline:
            time.sleep(0.5)
        os.kill(process.pid, signal.SIGCONT)

    out = tmp_path / "out"
    code, stderr = run_and_meddle(long_pipeline, out, ["--storage", str(storage)], pause)
    assert code == 0, stderr
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["status"] == "done" and len(metrics["progress"]) == ITERATIONS
    # the reports it rebuilt repeat the time before them; the others' steps measure the pipeline
    steps = [b["time"] - a["time"] for a, b in zip(metrics["progress"][:-1], metrics["progress"][1:], strict=True)]
    assert steps.count(0.0) > 10, "the pause swept no report: pause longer"
    assert metrics["samples_per_s"] == pytest.approx(64 / statistics.median([s for s in steps if s > 0]), rel=1e-3)


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "Ctrl-C"])
def test_sigterm_stops_a_run_as_ctrl_c_does(long_pipeline: Path, tmp_path: Path, stop: signal.Signals) -> None:
    """One line, the functions stopped, metrics.json saying how far it got, no stale lock, the keys kept."""
    out, storage = tmp_path / "out", tmp_path / "storage"
    code, stderr = run_and_meddle(
        long_pipeline, out, ["--storage", str(storage), "--run-id", "stopped"], lambda p: p.send_signal(stop)
    )
    how = "terminated (SIGTERM)" if stop == signal.SIGTERM else "interrupted"
    assert (code, stderr.strip().splitlines()[-1]) == (
        128 + stop if stop == signal.SIGTERM else 130,
        f"cloudless-run: {how}; the run's functions were stopped",
    ), stderr
    assert "Traceback" not in stderr
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["status"] == "interrupted" and 3 <= len(metrics["progress"]) < ITERATIONS
    assert not (out / RUN_LOCK).exists()
    assert any(p.is_file() for p in (storage / "stopped").rglob("*")), "the run's keys were deleted"
