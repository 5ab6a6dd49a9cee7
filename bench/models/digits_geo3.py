"""The digits MLP of samples/mlp_digits.py, its training data spread unevenly over three regions, for
bench/geo_bench.py with its catalog bench/geo3.yaml: 60% of the train split lies in aws-us-east-1,
25% in aws-eu-west-1 and 15% in aws-ap-southeast-1 (every region holds the whole test split).

Self-contained (a copy of samples/mlp_digits.py's model, data and optimizer), so that the benchmark
does not depend on the samples folder being importable.
"""

from collections.abc import Iterable

import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import Dataset

TRAINING = {
    "global_batch_size": 64,
    "micro_batch_sizes": [8, 16],
    "iterations": 200,
    "learning_rate": 0.1,
}

#: share of the train split held in each region (skewed on purpose)
SHARES = {
    "aws-us-east-1": (0.0, 0.60),
    "aws-eu-west-1": (0.60, 0.85),
    "aws-ap-southeast-1": (0.85, 1.0),
}


class _DigitsDataset(Dataset):
    def __init__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        self.images = images
        self.labels = labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[tuple[torch.Tensor], torch.Tensor]:
        return (self.images[i],), self.labels[i]


def _split(split: str) -> tuple[torch.Tensor, torch.Tensor]:
    digits = load_digits()
    images = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    n_train = int(0.8 * len(labels))
    if split == "train":
        idx = order[:n_train]
    elif split == "test":
        idx = order[n_train:]
    else:
        raise ValueError(f"unknown split {split!r}")
    return images[idx], labels[idx]


def load_shard(region: str, split: str) -> Dataset:
    images, labels = _split(split)
    if split != "train":
        return _DigitsDataset(images, labels)
    low, high = SHARES.get(region, (0.0, 0.0))
    first, last = round(low * len(images)), round(high * len(images))
    return _DigitsDataset(images[first:last], labels[first:last])


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(64, 128),
        nn.ReLU(),
        nn.Linear(128, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )


def example_inputs(batch_size: int) -> tuple[torch.Tensor]:
    images, _ = _split("train")
    return (images[:batch_size],)


def example_targets(batch_size: int) -> torch.Tensor:
    _, labels = _split("train")
    return labels[:batch_size]


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output, target)


def make_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=TRAINING["learning_rate"], momentum=0.9)
