"""A mid-sized MLP on synthetic data for the runtime benchmarks: enough compute per micro-batch that
the runtime's fixed costs show as overhead, and few enough parameters (1.1 M) that a few functions
fit this 2-core machine under emulation."""

import torch
from torch import nn
from torch.utils.data import TensorDataset

TRAINING = {"global_batch_size": 256, "micro_batch_sizes": [32], "iterations": 30, "learning_rate": 0.05}
FEATURES, HIDDEN, CLASSES = 256, 512, 10


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(FEATURES, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, CLASSES),
    )


def _data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, FEATURES, generator=generator)
    weights = torch.randn(FEATURES, CLASSES, generator=generator)
    return x, (x @ weights).argmax(dim=1)


def example_inputs(batch_size: int) -> tuple[torch.Tensor]:
    return (_data(batch_size, 1)[0],)


def example_targets(batch_size: int) -> torch.Tensor:
    return _data(batch_size, 1)[1]


class _Pairs(TensorDataset):
    def __getitem__(self, i: int):  # ((inputs,), target), as the model-file contract has it
        x, y = super().__getitem__(i)
        return (x,), y


def load_shard(region: str, split: str) -> TensorDataset:
    x, y = _data(4096 if split == "train" else 1024, 0 if split == "train" else 7)
    return _Pairs(x, y)


def make_optimizer(params):
    return torch.optim.SGD(params, lr=TRAINING["learning_rate"], momentum=0.9)
