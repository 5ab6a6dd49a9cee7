"""fx cannot trace this (range over a traced size); torch.export can."""

import torch
from _shards import ExampleShard, example_shard
from torch import nn


class Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cell = nn.Linear(8, 8)
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.zeros(x.shape[0], 8)
        for t in range(x.shape[1]):
            h = torch.tanh(self.cell(h) + x[:, t])
        return self.out(h)


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return Recurrent()


def example_inputs(batch_size: int) -> tuple[torch.Tensor]:
    return (torch.randn(batch_size, 5, 8, generator=torch.Generator().manual_seed(0)),)


def example_targets(batch_size: int) -> torch.Tensor:
    return torch.zeros(batch_size, dtype=torch.long)


def load_shard(region: str, split: str) -> ExampleShard:
    return example_shard(example_inputs, example_targets, split)
