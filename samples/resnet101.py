"""ResNet-101 (bottleneck blocks, 1,000 ImageNet classes, 3x224x224 input) in plain torch.

Same synthetic data, loss, optimizer and training settings as resnet50.py; only the depth differs.
The network itself lives in _resnet.py.
"""

from _resnet import build_resnet
from resnet50 import TRAINING, example_inputs, example_targets, load_shard, loss_fn, make_optimizer
from torch import nn

__all__ = ["TRAINING", "build_model", "example_inputs", "example_targets", "load_shard", "loss_fn", "make_optimizer"]


def build_model() -> nn.Module:
    return build_resnet(101)  # calls torch.manual_seed(0)
