"""A small MLP (64 -> 128 -> 64 -> 10) that classifies 8x8 handwritten digits.

Data: scikit-learn's bundled ``load_digits`` set (1,797 images, no download).
Pixels are scaled to [0, 1]. A seeded permutation puts the first 80% in
"train" and the rest in "test"; every region gets the whole split.
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
    # Momentum matters here: plain SGD at lr 0.1 sits around 87-92% test accuracy
    # after 200 iterations, with momentum 0.9 it reliably reaches ~95-98%.
    return torch.optim.SGD(params, lr=TRAINING["learning_rate"], momentum=0.9)


def load_shard(region: str, split: str) -> Dataset:
    return _DigitsDataset(*_split(split))
