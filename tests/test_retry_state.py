"""Issue 47 item 1: a retry is invisible. A warm function (the same process, the same worker) whose
invocation failed part-way through an iteration's backward passes is invoked again: it must continue
from exactly its last checkpoint, with nothing of the failed attempt in memory (the gradients it had
accumulated), and end bit-identical to an undisturbed run."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from cloudless.ir.protocol import gradient_key, namespace, state_key
from cloudless.ir.schedule import compute_order, local_micro_batches
from cloudless.runtimes.function import worker as worker_module
from cloudless.runtimes.function.worker import StageWorker, handle_request
from cloudless.runtimes.storage.channels import DirectoryChannel
from cloudless.runtimes.storage.tensors import unpack
from tests.runtime_cases import front_end, write_packages, write_training_data

ITERATIONS = 4
RUN = "r"


class TransientError(OSError):
    """What a storage request answers for a moment (S3's 503 SlowDown, a reset connection)."""


class FailingOnce(DirectoryChannel):
    """A storage folder whose read of one key fails once, as a transient cloud error would."""

    def __init__(self, root: Path, key: str) -> None:
        super().__init__(root)
        self.key, self.failed = key, threading.Event()

    def try_get(self, key: str) -> bytes | None:
        if key == self.key and not self.failed.is_set():
            self.failed.set()
            raise TransientError(f"{key}: 503 SlowDown")
        return super().try_get(key)


@pytest.fixture(scope="module")
def two_stage_build(tmp_path_factory: pytest.TempPathFactory):
    result = front_end()
    n_blocks = len(result.chain.blocks)
    folder = tmp_path_factory.mktemp("retry")
    workflow = write_packages(
        result,
        folder / "build",
        [(0, 0, 1), (1, n_blocks - 1, 1)],
        micro_batch=8,
        global_batch=32,
        iterations=ITERATIONS,
    )
    assert workflow.run.checkpoint_every <= 2 and workflow.run.micro_batches == 4
    return result, workflow, folder / "build"


def _storage(result, workflow, folder: Path) -> Path:
    write_training_data(result, DirectoryChannel(folder), workflow.regions[0].name)
    return folder


def _final_states(workflow, storage: Path) -> list[dict[str, torch.Tensor]]:
    space = namespace(RUN, workflow.regions[0].name)
    channel = DirectoryChannel(storage)
    return [unpack(channel.get(state_key(space, f.stage, ITERATIONS), 0)) for f in workflow.regions[0].functions]


def _train(build: Path, workflow, storage: Path, upstream: DirectoryChannel, monkeypatch, *, retried: bool) -> None:
    """Stage 1 in a thread of its own (a StageWorker), stage 0 through `handle_request` over `upstream`, as a
    warm function process serves it: once, or (`retried`) failing at first and invoked again."""
    first, second = workflow.regions[0].functions
    monkeypatch.setattr(worker_module, "open_channel", lambda location: upstream)
    monkeypatch.setattr(worker_module, "_IDLE", {})
    downstream = threading.Thread(
        target=lambda: StageWorker(build / second.package, DirectoryChannel(storage)).run(
            0, ITERATIONS, 0, timeout=60, run=RUN
        )
    )
    downstream.start()
    event = {"start": 0, "stop": ITERATIONS, "replica": 0, "run": RUN, "timeout": 60}
    if retried:
        with pytest.raises(TransientError):
            handle_request(build / first.package, event, str(storage))
    handle_request(build / first.package, event, str(storage))  # the platform's retry, in the same process
    downstream.join(120)
    assert not downstream.is_alive()


@pytest.mark.slow  # two 4-iteration runs of a 2-stage pipeline
def test_a_warm_worker_retried_after_failing_mid_backward_ends_as_an_undisturbed_run(
    two_stage_build, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stage 0 reads iteration 2's gradients (after its checkpoint at 2); the read of the last one it needs
    fails after the backward passes of the others have added into `.grad`. The same warm process is
    invoked again (`handle_request`, as Lambda and OpenFaaS reuse it): it resumes from the checkpoint at 2
    and ends with every tensor of both stages equal to the undisturbed run's, run the same way."""
    result, workflow, build = two_stage_build
    region = workflow.regions[0]
    undisturbed = _storage(result, workflow, tmp_path / "undisturbed")
    _train(build, workflow, undisturbed, DirectoryChannel(undisturbed), monkeypatch, retried=False)
    expected = _final_states(workflow, undisturbed)

    storage = _storage(result, workflow, tmp_path / "disturbed")
    space = namespace(RUN, region.name)
    order = compute_order(workflow.run.schedule, local_micro_batches(workflow.run.micro_batches, 1, 0), 0)
    backwards = [m for kind, m in order if kind == "backward"]
    flaky = FailingOnce(storage, gradient_key(space, 2, region.functions[1].stage, backwards[-1]))
    _train(build, workflow, storage, flaky, monkeypatch, retried=True)
    assert flaky.failed.is_set()
    got = _final_states(workflow, storage)
    for stage, (mine, theirs) in enumerate(zip(got, expected, strict=True)):
        assert mine.keys() == theirs.keys()
        differing = sorted(name for name in theirs if not torch.equal(mine[name], theirs[name]))
        assert not differing, f"stage {stage}: {differing} differ from the undisturbed run"


def test_an_invocation_of_an_abandoned_attempt_stops_waiting_within_seconds(two_stage_build, tmp_path: Path) -> None:
    """Stage 1 of attempt 0 waits for activations that stage 0 (its execution failed) will never send. The
    driver starts attempt 1 and says so (`attempt_key`): the waiting invocation stops within a few seconds,
    not after its 600 s key timeout, and writes no completion marker; an invocation of the newest attempt
    is not stopped by it."""
    from cloudless.ir.protocol import attempt_key, done_key

    result, workflow, build = two_stage_build
    storage = _storage(result, workflow, tmp_path / "storage")
    region = workflow.regions[0]
    last = region.functions[-1]
    space = namespace(RUN, region.name)
    answers: dict[int, dict] = {}

    def invoke(attempt: int) -> None:
        event = {"start": 0, "stop": ITERATIONS, "replica": 0, "run": RUN, "attempt": attempt, "timeout": 600}
        answers[attempt] = handle_request(build / last.package, event, str(storage))

    waiting = threading.Thread(target=invoke, args=(0,), daemon=True)
    waiting.start()
    channel = DirectoryChannel(storage)
    channel.put(attempt_key(space), b"0")  # the current attempt: nothing abandoned yet
    waiting.join(3)
    assert waiting.is_alive()
    channel.put(attempt_key(space), b"1")
    waiting.join(60)  # a loaded machine's margin; the check runs about once a second
    assert not waiting.is_alive()
    assert answers[0]["status"] == "aborted" and "attempt 0 was abandoned" in answers[0]["reason"]
    assert not channel.exists(done_key(space, last.name, 0, 0))
    newest = threading.Thread(target=invoke, args=(1,), daemon=True)
    newest.start()
    newest.join(3)
    assert newest.is_alive()  # still waiting for stage 0, as it should
    channel.put(attempt_key(space), b"2")  # and abandoned in turn, so that the test ends
    newest.join(60)
    assert answers[1]["status"] == "aborted"
