"""ResNet-50/101 (bottleneck blocks) in plain torch, shared by resnet50.py and resnet101.py.

Follows the torchvision layout (stride on the 3x3 conv), takes 3x224x224 images
and predicts 1,000 classes. No data-dependent control flow, so it can be traced
with ``torch.fx.symbolic_trace``.
"""

import zlib

import torch
from torch import nn
from torch.utils.data import TensorDataset

LAYERS = {50: [3, 4, 6, 3], 101: [3, 4, 23, 3]}
NUM_CLASSES = 1000
IMAGE_SIZE = 224


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, in_ch: int, width: int, stride: int = 1) -> None:
        super().__init__()
        out_ch = width * self.expansion
        self.conv1 = nn.Conv2d(in_ch, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_ch, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_ch)
        self.relu = nn.ReLU(inplace=True)
        self.downsample: nn.Module = nn.Identity()
        if stride != 1 or in_ch != out_ch:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_ch),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + self.downsample(x))


class ResNet(nn.Module):
    def __init__(self, depth: int = 50, num_classes: int = NUM_CLASSES) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        in_ch = 64
        stages = []
        for i, n_blocks in enumerate(LAYERS[depth]):
            width = 64 * 2**i
            blocks = []
            for j in range(n_blocks):
                stride = 2 if i > 0 and j == 0 else 1
                blocks.append(Bottleneck(in_ch, width, stride))
                in_ch = width * Bottleneck.expansion
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(in_ch, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        x = torch.flatten(self.avgpool(x), 1)
        return self.fc(x)


def build_resnet(depth: int) -> nn.Module:
    torch.manual_seed(0)
    return ResNet(depth)


def random_images(batch_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic synthetic (images, labels)."""
    gen = torch.Generator().manual_seed(seed)
    images = torch.randn(batch_size, 3, IMAGE_SIZE, IMAGE_SIZE, generator=gen)
    labels = torch.randint(0, NUM_CLASSES, (batch_size,), generator=gen)
    return images, labels


class ImageShard(TensorDataset):
    """A TensorDataset of (images, labels) whose items are ((image,), label)."""

    def __getitem__(self, i: int) -> tuple[tuple[torch.Tensor], torch.Tensor]:
        image, label = super().__getitem__(i)
        return (image,), label


def synthetic_shard(region: str, split: str, size: int = 256) -> ImageShard:
    """Synthetic images seeded by a stable function (crc32) of (region, split)."""
    return ImageShard(*random_images(size, zlib.crc32(f"{region}/{split}".encode())))
