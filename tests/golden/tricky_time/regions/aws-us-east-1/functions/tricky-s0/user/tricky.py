"""A small model with the awkward parts: a module called twice, a long skip connection, BatchNorm
(buffers), tied input/output embeddings, two inputs and a structured (dict) output."""

import torch
from _shards import ExampleShard, example_shard
from torch import nn


class Tricky(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.proj = nn.Linear(16, 16)
        self.norm = nn.BatchNorm1d(16)
        self.mix = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor, scale: torch.Tensor) -> dict[str, torch.Tensor]:
        x = self.embed(tokens).mean(1)
        skip = x
        x = torch.relu(self.proj(x))
        x = self.norm(x)
        x = self.proj(x) * scale  # the same module again
        x = self.drop(self.mix(x))
        x = x + skip  # long skip connection
        return {"logits": self.head(x), "features": x}


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return Tricky()


def example_inputs(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 50, (batch_size, 7), generator=g), torch.rand(batch_size, 1, generator=g) + 0.5


def example_targets(batch_size: int) -> torch.Tensor:
    return torch.randint(0, 50, (batch_size,), generator=torch.Generator().manual_seed(2))


def loss_fn(output: dict[str, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output["logits"], target) + output["features"].pow(2).mean()


TRAINING = {"global_batch_size": 16, "micro_batch_sizes": [4], "iterations": 10, "learning_rate": 0.1}


def load_shard(region: str, split: str) -> ExampleShard:
    return example_shard(example_inputs, example_targets, split)
