"""Training data in storage: shards, and the order a run reads samples in."""

from __future__ import annotations

from pathlib import Path

import torch

from cloudless.ir.schedule import epoch_permutation, sample_indices
from cloudless.runtimes.data import SplitReader, write_split
from cloudless.runtimes.storage import DirectoryChannel


def test_gather_across_shards_returns_samples_in_order(tmp_path: Path) -> None:
    images = torch.arange(13 * 3, dtype=torch.float32).reshape(13, 3)
    labels = torch.arange(13) * 10
    channel = DirectoryChannel(tmp_path)
    samples = (([images[i]], [labels[i]]) for i in range(13))
    assert write_split(channel, "r", "train", samples, shard_samples=5) == 13
    reader = SplitReader(channel, "r")
    for indices in ([12, 0, 7, 3, 11, 5], [2, 4], [10, 12]):
        (inputs,) = reader.gather(indices, "input")
        (targets,) = reader.gather(indices, "target")
        assert torch.equal(inputs, images[indices]) and torch.equal(targets, labels[indices])


def test_sample_order_is_a_seeded_permutation_per_epoch() -> None:
    n, batch = 37, 16
    # Iterations 0..4 read 80 positions: each epoch's 37 samples exactly once, then the next epoch.
    read = [i for it in range(5) for m in range(2) for i in sample_indices(it, m, 8, batch, n, seed=3)]
    assert sorted(read[:37]) == list(range(37)) and sorted(read[37:74]) == list(range(37))
    assert read[:37] == epoch_permutation(n, 3, 0).tolist() and read[37:74] == epoch_permutation(n, 3, 1).tolist()
    assert read[:37] != epoch_permutation(n, 4, 0).tolist()  # the seed matters
