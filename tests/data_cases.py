"""What the data tests' model files share: a small MLP over the 64 pixels of scikit-learn's digits, as
model-file source (each test adds its TRAINING and its data)."""

DIGITS_MLP = """
import torch
from torch import nn


def build_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


def example_inputs(batch_size):
    return (torch.zeros(batch_size, 64),)


def example_targets(batch_size):
    return torch.zeros(batch_size, dtype=torch.int64)
"""

#: the rest of a small model file of 8 features and 3 classes (each test adds its imports, TRAINING and
#: build_model): its example inputs and targets, loss, and data (160 training samples, 64 test samples)
EIGHT_FEATURES = """
def example_inputs(batch_size):
    return (torch.randn(batch_size, 8),)


def example_targets(batch_size):
    return torch.zeros(batch_size, dtype=torch.int64)


def loss_fn(output, target):
    return nn.functional.cross_entropy(output, target)


class _Data(torch.utils.data.Dataset):
    def __init__(self, n, seed):
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 8, generator=generator)
        self.y = (self.x[:, 0] > 0).long() + (self.x[:, 1] > 0).long()

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return (self.x[i],), self.y[i]


def load_shard(region, split):
    return _Data(160 if split == "train" else 64, 0 if split == "train" else 1)
"""
