"""In-place ops (ReLU(inplace=True), add_) and a convolution with BatchNorm: cuts must respect mutation."""

import torch
from _shards import ExampleShard, example_shard
from torch import nn


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.act = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.act(self.bn1(self.conv1(x)))
        z = self.bn2(self.conv2(y))
        z.add_(y)
        z = self.act(z)
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(z, 1), 1))


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return Net()


def example_inputs(batch_size: int) -> tuple[torch.Tensor]:
    return (torch.randn(batch_size, 3, 8, 8, generator=torch.Generator().manual_seed(0)),)


def example_targets(batch_size: int) -> torch.Tensor:
    return torch.arange(batch_size) % 4


def load_shard(region: str, split: str) -> ExampleShard:
    return example_shard(example_inputs, example_targets, split)
