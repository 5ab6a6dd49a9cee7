"""Issue 32 item 5: recovery falls back to what storage still holds whole. A damaged record of the newest
checkpoint (`state/s<k>/latest`) is a hint that failed: a resumed run, and a retried invocation, find the
checkpoints themselves. A damaged staged shard is re-staged (saying why) instead of reused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from cloudless.ir.protocol import (
    DATA_META,
    data_key,
    done_key,
    latest_state_key,
    namespace,
    shard_name,
    state_key,
)
from cloudless.ir.workflow import Workflow
from cloudless.runtimes.cli import main as run_main
from cloudless.runtimes.function.data import write_split
from cloudless.runtimes.function.worker import StageWorker
from cloudless.runtimes.storage.channels import DirectoryChannel
from tests.runtime_cases import MLP, front_end, write_packages, write_training_data

ITERATIONS = 6
RUN = "whole"


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Workflow, Path, dict[str, torch.Tensor]]:
    """A 3-stage build of the MLP with replicas (2, 3, 1) run to its end with --keep-storage: the build,
    its workflow, the folder holding the run's `out` and `storage`, and the trained parameters."""
    result = front_end()
    n_blocks = len(result.chain.blocks)
    stages = [(0, 0, 2), (1, n_blocks - 2, 3), (n_blocks - 1, n_blocks - 1, 1)]
    folder = tmp_path_factory.mktemp("finished")
    build = folder / "build"
    workflow = write_packages(
        result, build, stages, micro_batch=8, global_batch=64, iterations=ITERATIONS, schedule="1f1b"
    )
    assert workflow.run.checkpoint_every == 2
    argv = [str(build), "--out", str(folder / "out"), "--storage", str(folder / "storage"), "--model", str(MLP)]
    assert run_main([*argv, "-q", "--run-id", RUN, "--keep-storage"]) == 0
    return build, workflow, folder, load_file(folder / "out" / "model.safetensors")


def _copy(finished: tuple[Path, Workflow, Path, Any], tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the finished run's storage and out (each test damages its own): (storage, out)."""
    _, _, folder, _ = finished
    shutil.copytree(folder / "storage", tmp_path / "storage", symlinks=True)
    shutil.copytree(folder / "out", tmp_path / "out", symlinks=True)
    return tmp_path / "storage", tmp_path / "out"


def _same(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[name], expected[name]) for name in expected)


@pytest.mark.slow  # whole runs of the 3-stage pipeline (the fast lane checks the pieces below)
def test_a_damaged_checkpoint_record_resumes_from_the_newest_whole_checkpoint(
    finished, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The run stopped after its checkpoint at iteration 4 (the ones at 6 are gone) and stage 0's record
    of its newest checkpoint is garbage: --resume resumes from 4 and ends with the same parameters."""
    build, workflow, _, expected = finished
    storage, out = _copy(finished, tmp_path)
    space = namespace(RUN, workflow.regions[0].name)
    for function in workflow.regions[0].functions:
        (storage / state_key(space, function.stage, ITERATIONS)).unlink()
    (storage / latest_state_key(space, 0)).write_bytes(b"\x00garbage\xff" * 3)
    capsys.readouterr()
    argv = [str(build), "--out", str(out), "--storage", str(storage), "--model", str(MLP), "-q", "--resume", RUN]
    code = run_main(argv)
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert f"resuming run {RUN} from iteration 4" in captured.out
    _same(load_file(out / "model.safetensors"), expected)
    assert json.loads((out / "metrics.json").read_text())["retries"] == 0


def test_a_retry_with_a_damaged_record_finds_the_checkpoints_itself(tmp_path: Path) -> None:
    """A retried invocation reads the record to find its resume point: damaged (not sealed, or not
    JSON) or naming a checkpoint that is gone, it looks for the checkpoints in its range instead."""
    result = front_end()
    n_blocks = len(result.chain.blocks)
    workflow = write_packages(
        result, tmp_path / "build", [(0, n_blocks - 1, 1)], micro_batch=8, global_batch=16, iterations=ITERATIONS
    )
    region = workflow.regions[0]
    storage = tmp_path / "storage"
    write_training_data(result, DirectoryChannel(storage), region.name)
    package = tmp_path / "build" / region.functions[0].package
    first = StageWorker(package, DirectoryChannel(storage)).run(0, ITERATIONS, 0, run="r", attempt=0)
    assert first.status == "done"
    space = namespace("r", region.name)
    record = storage / latest_state_key(space, 0)
    final = (storage / state_key(space, 0, ITERATIONS)).read_bytes()
    (storage / state_key(space, 0, ITERATIONS)).unlink()
    channel = DirectoryChannel(storage)
    for attempt, damage in enumerate(
        (
            lambda: record.write_bytes(b"not sealed at all"),
            lambda: channel.put(latest_state_key(space, 0), b"{not json"),
            lambda: channel.put(latest_state_key(space, 0), json.dumps({"latest": 40, "between": []}).encode()),
        ),
        start=1,
    ):
        damage()
        (storage / done_key(space, region.functions[0].name, 0, 0)).unlink()  # else it is a duplicate
        retried = StageWorker(package, DirectoryChannel(storage)).run(0, ITERATIONS, 0, run="r", attempt=attempt)
        assert (retried.status, retried.resumed, retried.stop) == ("done", 4, ITERATIONS), attempt
        assert retried.losses == first.losses[-len(retried.losses) :]
        assert (storage / state_key(space, 0, ITERATIONS)).read_bytes() == final  # the same bytes again
        assert json.loads(channel.get(latest_state_key(space, 0)))["latest"] == ITERATIONS  # and a good record
        (storage / state_key(space, 0, ITERATIONS)).unlink()
    # A long range whose record names checkpoints that are gone: the one further down is found.
    worker = StageWorker(package, DirectoryChannel(storage))
    worker.invocation.namespace = space
    channel.put(latest_state_key(space, 0), json.dumps({"latest": 38, "between": []}).encode())
    channel.put(state_key(space, 0, 20), b"only its presence is looked at")
    assert worker.checkpoints.resume_point(0, 40, 1) == 20
    assert worker.checkpoints.resume_point(0, 20, 1) == 4  # in the range: it20 is the range's end


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.slow  # whole runs of the 3-stage pipeline (the fast lane checks the pieces below)
def test_a_damaged_shard_is_restaged_and_the_run_trains(finished, tmp_path: Path, capsys) -> None:
    """A staged train shard with flipped bytes: the next run re-stages it (saying so, and why) and trains
    to the same parameters, instead of reusing it and failing in every function."""
    build, workflow, _, expected = finished
    storage, _ = _copy(finished, tmp_path)
    name = workflow.regions[0].name
    shard = storage / data_key(name, "train", shard_name(0))
    _flip(shard, shard.stat().st_size // 2)
    capsys.readouterr()
    out = tmp_path / "again"
    code = run_main([str(build), "--out", str(out), "--storage", str(storage), "--model", str(MLP)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    (banner,) = [line for line in captured.out.splitlines() if line.startswith("data: ")]
    assert ", restaged: " in banner and f"{shard_name(0)}: corrupt" in banner, banner
    assert ", reused)" in banner  # the test split was whole
    _same(load_file(out / "model.safetensors"), expected)
    assert json.loads((out / "metrics.json").read_text())["retries"] == 0


def _samples(n: int) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    return [([torch.full((3,), float(i))], [torch.tensor(i % 4)]) for i in range(n)]


def test_staging_verifies_what_it_reuses(tmp_path: Path) -> None:
    """write_split reads back every shard it would reuse: a damaged one (flipped bytes, a shard of other
    data under its name, gone) and a damaged meta are re-staged, with why; whole ones are reused."""
    channel = DirectoryChannel(tmp_path)
    assert write_split(channel, "r", "train", _samples(13), shard_samples=5).action == "staged"
    whole = write_split(channel, "r", "train", _samples(13), shard_samples=5)
    assert (whole.action, whole.reason) == ("reused", "")
    shards = [tmp_path / data_key("r", "train", shard_name(i)) for i in range(3)]
    good = [s.read_bytes() for s in shards]
    other = tmp_path / "other"
    write_split(DirectoryChannel(other), "r", "train", [([x + 1 for x in xs], ys) for xs, ys in _samples(13)], 5)
    for damage, why in (
        (lambda: _flip(shards[1], -3), f"{shards[1]}: corrupt: "),
        (lambda: shards[2].write_bytes((other / data_key("r", "train", shard_name(2))).read_bytes()), "other data"),
        (lambda: shards[0].unlink(), f"{shards[0]} is missing"),
        (lambda: _flip(tmp_path / data_key("r", "train", DATA_META), -2), f"{DATA_META}: corrupt: "),
    ):
        damage()
        written = write_split(channel, "r", "train", _samples(13), shard_samples=5)
        assert written.action == "restaged" and why in written.reason, (written, why)
        assert [s.read_bytes() for s in shards] == good
        assert write_split(channel, "r", "train", _samples(13), shard_samples=5).action == "reused"
