"""Training data for the test models: per-sample slices of their own example inputs and targets, so
that any of them can be staged and trained by `cloudless-run` (load_shard(region, split))."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import Dataset

TRAIN_SAMPLES = 32
TEST_SAMPLES = 8


class ExampleShard(Dataset):
    """Sample i of `inputs` (tensors with the batch first) and of `targets`, as ((inputs...), target)."""

    def __init__(self, inputs: tuple[torch.Tensor, ...], targets: torch.Tensor) -> None:
        self.inputs = inputs
        self.targets = targets

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        return tuple(t[i] for t in self.inputs), self.targets[i]


def example_shard(
    example_inputs: Callable[[int], Any], example_targets: Callable[[int], torch.Tensor], split: str
) -> ExampleShard:
    """The train split is the first TRAIN_SAMPLES rows of the examples of TRAIN_SAMPLES + TEST_SAMPLES,
    the test split the rest (the examples are seeded: the same rows every call)."""
    total = TRAIN_SAMPLES + TEST_SAMPLES
    inputs, targets = example_inputs(total), example_targets(total)
    rows = slice(0, TRAIN_SAMPLES) if split == "train" else slice(TRAIN_SAMPLES, total)
    return ExampleShard(tuple(t[rows] for t in inputs), targets[rows])
