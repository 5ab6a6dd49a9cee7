"""A compute-heavy MLP on synthetic data: big global batch, few parameters, so that the fastest
plan replicates and pipelines (used by the golden tests for a multi-stage, multi-replica tree)."""

import torch
from _shards import ExampleShard, example_shard
from torch import nn

TRAINING = {"global_batch_size": 16384, "micro_batch_sizes": [256, 512], "iterations": 10, "learning_rate": 0.05}


def build_model() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(6):
        layers += [nn.Linear(1024, 1024), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(1024, 10))


def example_inputs(batch_size: int) -> tuple[torch.Tensor]:
    return (torch.randn(batch_size, 1024, generator=torch.Generator().manual_seed(1)),)


def example_targets(batch_size: int) -> torch.Tensor:
    return torch.randint(0, 10, (batch_size,), generator=torch.Generator().manual_seed(2))


def load_shard(region: str, split: str) -> ExampleShard:
    return example_shard(example_inputs, example_targets, split)
