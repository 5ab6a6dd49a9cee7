"""ResNet-101 (bottleneck blocks, 1,000 ImageNet classes, 3x224x224 input) in plain torch.

Data: synthetic. Images are standard-normal noise and labels are uniform in
0..999, generated from a seed derived (via zlib.crc32) from (region, split), so
every shard is deterministic. The network itself lives in _resnet.py.
"""

from collections.abc import Iterable

import torch
from _resnet import ImageShard, build_resnet, random_images, synthetic_shard
from torch import nn

TRAINING = {
    "global_batch_size": 64,
    "micro_batch_sizes": [4, 8],
    "iterations": 100,
    "learning_rate": 0.1,
}


def build_model() -> nn.Module:
    return build_resnet(101)  # calls torch.manual_seed(0)


def example_inputs(batch_size: int) -> tuple[torch.Tensor]:
    images, _ = random_images(batch_size, seed=0)
    return (images,)


def example_targets(batch_size: int) -> torch.Tensor:
    _, labels = random_images(batch_size, seed=0)
    return labels


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output, target)


def make_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=TRAINING["learning_rate"], momentum=0.9)


def load_shard(region: str, split: str) -> ImageShard:
    return synthetic_shard(region, split)
