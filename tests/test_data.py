"""Training data in storage: shards, the order a run reads samples in, and staging by fingerprint."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from cloudless.ir.protocol import DATA_META, data_key, shard_name
from cloudless.ir.sample_order import STAGED_SHARD_BYTES, ShardOrder, staged_shard_samples, staging_order
from cloudless.runtimes.control.staging import DataError, StagedData, describe_staged, stage_data
from cloudless.runtimes.function.batches import open_batches
from cloudless.runtimes.function.data import SplitChangedError, read_meta, staged_entries, staged_shards, write_split
from cloudless.runtimes.storage.channels import DirectoryChannel


def _no_user_code() -> None:
    raise AssertionError("staged data needs no model file")


def test_staged_shards_are_read_in_the_shard_order_as_micro_batches(tmp_path: Path) -> None:
    images = torch.arange(13 * 3, dtype=torch.float32).reshape(13, 3)
    labels = torch.arange(13) * 10
    channel = DirectoryChannel(tmp_path)
    samples = (([images[i]], [labels[i]]) for i in range(13))
    assert write_split(channel, "r", "train", samples, shard_samples=5).samples == 13
    meta = read_meta(channel, "r", "train")
    assert meta is not None and meta["format"] == "staged"
    batches = open_batches(
        channel, meta, "r", "train", _no_user_code, seed=3, micro_batch=4, global_batch=8, timeout=5.0
    )
    order = ShardOrder((5, 5, 3), 3)
    for iteration, m in ((0, 0), (0, 1), (1, 0), (3, 1)):  # iteration 3 wraps into epoch 2
        rows = [order.at(iteration * 8 + m * 4 + k).index for k in range(4)]
        staged = [batches.transformed(located, batches.read(located)) for located in batches.positions(iteration, m)]
        inputs, targets = batches.collate(staged)
        assert torch.equal(inputs[0], images[rows]) and torch.equal(targets[0], labels[rows])
    assert batches.reader.held <= batches.order.shuffle_shards + 1  # a group's shards and one more, not all


def test_a_first_stage_reads_each_shard_about_once_an_epoch_within_its_cache(tmp_path: Path) -> None:
    """Prefetch never lets go of a shard the next micro-batch reads, though one straddling two shuffle groups
    reads more shards than the cache holds: over an epoch, a shard is read again only rarely (it was read
    48 times for 20 shards, as the bench's 167-sample shards and micro-batches of 32 are)."""
    channel = DirectoryChannel(tmp_path)
    samples = (([torch.full((3,), float(i))], [torch.tensor(i)]) for i in range(20 * 167))
    write_split(channel, "r", "train", samples, shard_samples=167)
    meta = read_meta(channel, "r", "train")
    assert meta is not None
    batches = open_batches(
        channel, meta, "r", "train", _no_user_code, seed=0, micro_batch=32, global_batch=32, timeout=5
    )
    read: list[str] = []
    load = batches.reader.load
    assert load is not None
    batches.reader.load = lambda entry: (read.append(entry.location), load(entry))[1]
    for iteration in range(20 * 167 // 32):  # an epoch
        for located in batches.positions(iteration, 0):
            batches.read(located)
            assert batches.reader.held <= batches.reader.capacity
        batches.prefetch(iteration + 1, 0)
    assert len(set(read)) == 20 and len(read) <= 24, len(read)


def test_a_map_style_train_split_is_staged_in_a_permutation_of_its_count_alone() -> None:
    order = staging_order(37).tolist()
    assert sorted(order) == list(range(37)) and order != list(range(37))
    assert staging_order(37).tolist() == order  # no run seed: the same dataset stages the same shards
    assert staging_order(38).tolist()[:5] != order[:5]


def test_a_staged_shard_holds_about_16_mb_of_large_samples() -> None:
    assert staged_shard_samples(256) == 4096  # small samples: SHARD_SAMPLES
    image = 3 * 224 * 224 * 4  # a float image of 600 kB
    assert staged_shard_samples(image) == STAGED_SHARD_BYTES // image == 27
    assert staged_shard_samples(10**9) == 1


# --- staging: the data in storage is what load_shard gives now -----------------------------------------

SHARD = 5  # small shards, so that 13 samples take three

MODEL = """
import torch
from torch.utils.data import TensorDataset

COUNTS = {{"train": {train}, "test": {test}}}


def load_shard(region, split):
    n = COUNTS[split]
    if n is None:
        raise KeyError(f"no {{split}} split")
    x = torch.arange(n * 3, dtype=torch.float32).reshape(n, 3) * {scale}
    if {bump} < n:
        x[{bump}] += 1000
    return TensorDataset(x, torch.arange(n) % 4)

{extra}
"""


def expected(n: int, scale: float = 1.0, bump: int = 10**6) -> torch.Tensor:
    x = torch.arange(n * 3, dtype=torch.float32).reshape(n, 3) * scale
    if bump < n:
        x[bump] += 1000
    return x


class RecordingChannel(DirectoryChannel):
    """A folder channel that records its writes and deletes, in order."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.writes: list[tuple[str, str]] = []

    def put(self, key: str, data: bytes) -> None:
        self.writes.append(("put", key))
        super().put(key, data)

    def delete(self, key: str) -> None:
        self.writes.append(("delete", key))
        super().delete(key)


@pytest.fixture
def versions(model_file: Callable[[str, str], Path]) -> Callable[..., Path]:
    """A model file per version of load_shard. Each gets its own name: a rewrite of one file within
    the same second, at the same size, could be imported from its stale bytecode."""
    made: list[Path] = []

    def write(*, train: int = 13, test: int | None = 6, scale: float = 1.0, bump: int = 10**6, extra: str = "") -> Path:
        source = MODEL.format(train=train, test=test, scale=scale, bump=bump, extra=extra)
        made.append(model_file(source, f"v{len(made)}.py"))
        return made[-1]

    return write


def stage(root: Path, model: Path) -> tuple[RecordingChannel, StagedData]:
    channel = RecordingChannel(root)
    return channel, stage_data(channel, "r", model, shard_samples=SHARD)


def read_all(channel: DirectoryChannel, split: str = "train") -> torch.Tensor:
    """The split's inputs as its shards hold them, row after row."""
    meta = meta_of(channel, split)
    read = staged_shards(channel, meta, 5.0)
    return torch.stack([row["inputs"][0] for entry in staged_entries(meta, "r", split) for row in read(entry)])


def as_staged(x: torch.Tensor, split: str = "train") -> torch.Tensor:
    """A dataset's samples in the rows a staging writes them in (a train split's in `staging_order`)."""
    return x[staging_order(len(x))] if split == "train" else x


def meta_of(channel: DirectoryChannel, split: str = "train") -> dict:
    return json.loads(channel.get(data_key("r", split, DATA_META)))


def test_the_same_data_is_reused_without_a_write(tmp_path: Path, versions: Callable[..., Path]) -> None:
    first_model = versions()
    _, first = stage(tmp_path / "storage", first_model)
    assert first["train"] == 13 and first["test"] == 6
    assert first["action"] == {"train": "staged", "test": "staged"}
    assert all(re.fullmatch(r"sha256:[0-9a-f]{64}", fp) for fp in first["fingerprint"].values())
    staged_from = meta_of(DirectoryChannel(tmp_path / "storage"))["staged_from"]
    assert staged_from["model_sha256"] == hashlib.sha256(first_model.read_bytes()).hexdigest()
    # Another model file (the model edited) whose load_shard gives the same samples: nothing is written.
    channel, again = stage(tmp_path / "storage", versions(extra="def make_optimizer(params): ..."))
    assert channel.writes == []
    assert again["action"] == {"train": "reused", "test": "reused"} and again["fingerprint"] == first["fingerprint"]
    assert meta_of(channel)["staged_from"] == staged_from  # who staged it; not compared
    assert torch.equal(read_all(channel), as_staged(expected(13)))


def test_changed_values_are_restaged_meta_first_out_and_last_in(tmp_path: Path, versions: Callable[..., Path]) -> None:
    _, first = stage(tmp_path, versions())
    channel, again = stage(tmp_path, versions(scale=2.0))
    assert again["train"] == 13 and again["action"] == {"train": "restaged", "test": "restaged"}
    assert again["fingerprint"]["train"] != first["fingerprint"]["train"]
    assert torch.equal(read_all(channel), as_staged(expected(13, 2.0)))
    assert torch.equal(read_all(channel, "test"), expected(6, 2.0))
    for split, shards in (("train", 3), ("test", 2)):
        writes = [w for w in channel.writes if w[1].startswith(f"data/r/{split}/")]
        meta = data_key("r", split, DATA_META)
        # meta goes before any shard is touched and comes back after the last: a reader opens it first
        assert writes[0] == ("delete", meta) and writes[-1] == ("put", meta)
        assert writes[1:-1] == [("put", data_key("r", split, shard_name(i))) for i in range(shards)]


def test_only_the_shards_from_the_first_change_on_are_written(tmp_path: Path, versions: Callable[..., Path]) -> None:
    stage(tmp_path, versions())
    # a sample staged in shard 2 (of 3), not one of the test split's 6
    bumped = next(int(i) for i in staging_order(13)[2 * SHARD :] if i >= 6)
    channel, again = stage(tmp_path, versions(bump=bumped))
    assert again["action"] == {"train": "restaged", "test": "reused"}
    train = data_key("r", "train", DATA_META)
    assert channel.writes == [("delete", train), ("put", data_key("r", "train", shard_name(2))), ("put", train)]
    assert torch.equal(read_all(channel), as_staged(expected(13, bump=bumped)))


@pytest.mark.parametrize(("before", "after"), [(13, 7), (13, 10), (7, 13), (5, 13)])
def test_a_changed_count_is_restaged_and_never_reads_a_stale_sample(
    tmp_path: Path, versions: Callable[..., Path], before: int, after: int
) -> None:
    stage(tmp_path, versions(train=before))
    channel, again = stage(tmp_path, versions(train=after, scale=-1.0))
    assert again["train"] == after and again["action"]["train"] == "restaged"
    meta = meta_of(channel)
    assert meta["samples"] == after and meta["fingerprint"] == again["fingerprint"]["train"]
    assert torch.equal(read_all(channel), as_staged(expected(after, -1.0)))
    shards = -(-after // SHARD)
    # The surplus shards of the larger staging are gone, and the reader's index ends at its count.
    assert channel.try_get(data_key("r", "train", shard_name(shards - 1))) is not None
    assert channel.try_get(data_key("r", "train", shard_name(shards))) is None
    entries = staged_entries(meta, "r", "train")
    assert len(entries) == shards and sum(e.samples for e in entries) == after


def test_a_reader_of_the_old_staging_fails_rather_than_mixing(tmp_path: Path, versions: Callable[..., Path]) -> None:
    channel, _ = stage(tmp_path, versions())
    meta = meta_of(channel)
    read, entries = staged_shards(channel, meta, 5.0), staged_entries(meta, "r", "train")
    assert torch.equal(read(entries[0])[1]["inputs"][0], as_staged(expected(13))[1])
    stage(tmp_path, versions(scale=3.0))
    with pytest.raises(SplitChangedError, match="staged again"):
        read(entries[2])


def test_a_split_staged_without_a_fingerprint_is_restaged(tmp_path: Path, versions: Callable[..., Path]) -> None:
    model = versions()
    channel, first = stage(tmp_path, model)
    # As an older version left it: meta without fingerprint or shard digests (same data).
    meta = meta_of(channel)
    old = {k: meta[k] for k in ("samples", "shard_samples", "inputs", "targets")}
    channel.put(data_key("r", "train", DATA_META), json.dumps(old).encode())
    channel, again = stage(tmp_path, model)
    assert again["action"] == {"train": "restaged", "test": "reused"}
    assert again["fingerprint"] == first["fingerprint"]
    assert meta_of(channel)["fingerprint"] == first["fingerprint"]["train"]
    assert torch.equal(read_all(channel), as_staged(expected(13)))


def test_the_fingerprint_is_of_the_content_not_of_its_sharding(tmp_path: Path) -> None:
    def samples(scale: float) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
        return [([torch.full((2,), i * scale)], [torch.tensor(i)]) for i in range(9)]

    by_4 = write_split(DirectoryChannel(tmp_path / "a"), "r", "train", samples(1.0), shard_samples=4)
    by_5 = write_split(DirectoryChannel(tmp_path / "b"), "r", "train", samples(1.0), shard_samples=5)
    other = write_split(DirectoryChannel(tmp_path / "c"), "r", "train", samples(2.0), shard_samples=4)
    assert by_4.fingerprint == by_5.fingerprint != other.fingerprint
    # The same values as another dtype are other data.
    as_double = [([x.double() for x in xs], ys) for xs, ys in samples(1.0)]
    assert write_split(DirectoryChannel(tmp_path / "d"), "r", "train", as_double, 4).fingerprint != by_4.fingerprint
    # An older staging with other shard sizes is replaced.
    channel = DirectoryChannel(tmp_path / "a")
    assert write_split(channel, "r", "train", samples(1.0), shard_samples=5).action == "restaged"
    assert write_split(channel, "r", "train", samples(1.0), shard_samples=5).action == "reused"
    assert channel.try_get(data_key("r", "train", shard_name(2))) is None  # 9 by 4 took three shards


def test_a_test_split_load_shard_no_longer_gives_is_deleted(tmp_path: Path, versions: Callable[..., Path]) -> None:
    stage(tmp_path, versions())
    channel, again = stage(tmp_path, versions(test=None))
    assert again["train"] == 13 and again["action"] == {"train": "reused"}
    assert isinstance(again["test"], str) and "no test split" in again["test"]
    assert channel.try_get(data_key("r", "test", DATA_META)) is None
    assert channel.try_get(data_key("r", "test", shard_name(0))) is None


def test_the_banner_shows_samples_fingerprints_and_what_was_done(tmp_path: Path, versions: Callable[..., Path]) -> None:
    _, first = stage(tmp_path, versions())
    train, test = first["fingerprint"]["train"], first["fingerprint"]["test"]
    assert describe_staged(first) == (
        f"data: train 13 samples ({train[:19]}, staged), test 6 samples ({test[:19]}, staged)"
    )
    _, again = stage(tmp_path, versions(scale=2.0, test=None))
    banner = describe_staged(again)
    assert re.fullmatch(r"data: train 13 samples \(sha256:[0-9a-f]{12}, restaged\), no test split \(.*\)", banner)
    assert "\n" not in banner and len(banner) < 200


EXAMPLES = """
def example_inputs(batch_size):
    return (torch.zeros(batch_size, {features}),)


def example_targets(batch_size):
    return torch.zeros(batch_size, dtype=torch.{target_dtype})
"""


def test_staged_samples_are_checked_against_the_examples(tmp_path: Path, versions: Callable[..., Path]) -> None:
    """A sample that does not fit example_inputs / example_targets (one sample of their batch) is one
    error naming the split, the sample and the difference, before anything is written."""
    fits = versions(extra=EXAMPLES.format(features=3, target_dtype="int64"))
    assert stage(tmp_path / "fits", fits)[1]["train"] == 13
    shape = "but the example's is float32 of shape"
    for features, dtype, message in (
        (4, "int64", f"input 0 is float32 of shape [3], {shape} [4] (without the batch dimension)"),
        (3, "float32", f"target 0 is int64 of shape [], {shape} [] (without the batch dimension)"),
    ):
        model = versions(extra=EXAMPLES.format(features=features, target_dtype=dtype))
        channel = RecordingChannel(tmp_path / f"{features}-{dtype}")
        with pytest.raises(DataError) as caught:
            stage_data(channel, "r", model, shard_samples=SHARD)
        first = int(staging_order(13)[0])  # the first sample staged (a train split's order)
        assert str(caught.value) == f"{model}: load_shard('r', 'train')[{first}]: {message}"
        assert channel.writes == []


def test_samples_of_different_shapes_are_one_error_naming_them(tmp_path: Path) -> None:
    """Ragged data (a sequence not padded): the split, the samples and their shapes, not torch.stack's error."""
    from cloudless.runtimes.storage.channels import DirectoryChannel

    samples = [([torch.zeros(3)], [torch.tensor(0)]), ([torch.zeros(4)], [torch.tensor(1)])]
    with pytest.raises(ValueError) as raised:
        write_split(DirectoryChannel(tmp_path), "here", "train", iter(samples), shard_samples=8)
    assert str(raised.value) == (
        "the train split of here: input 0 of samples 0..1 has shapes (3,), (4,); every sample's must have one "
        "shape (pad or crop them in load_shard)"
    )


def test_a_run_finds_the_model_file_it_was_compiled_from_or_says_which_it_found(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """workflow.yaml names the model file as the compiler was given it, with its sha256: run from another
    folder, the run finds none or another file of that name, and says so instead of training on it."""
    from cloudless.ir.files import load_workflow
    from cloudless.runtimes.control.staging import recorded_model_file

    from .conftest import ROOT

    workflow = load_workflow(ROOT / "tests" / "golden" / "mlp_digits" / "workflow.yaml")
    assert workflow.data.model_file == "samples/mlp_digits.py" and workflow.data.model_sha256 is not None
    monkeypatch.chdir(tmp_path)
    fix = "run cloudless-run from the folder cloudless-compile ran in, or pass --model PATH"
    with pytest.raises(DataError) as missing:
        recorded_model_file(workflow, None)
    assert str(missing.value) == (
        f"samples/mlp_digits.py: the model file workflow.yaml names is not in {tmp_path}; {fix}"
    )
    other = tmp_path / "samples" / "mlp_digits.py"
    other.parent.mkdir()
    other.write_text("# another project's model file of the same name\n")
    with pytest.raises(DataError, match=r"^samples/mlp_digits.py: not the model file the build was compiled from "):
        recorded_model_file(workflow, None)
    assert recorded_model_file(workflow, other) == other  # --model: the user's choice
    other.write_bytes((ROOT / "samples" / "mlp_digits.py").read_bytes())
    assert recorded_model_file(workflow, None) == Path("samples/mlp_digits.py")
