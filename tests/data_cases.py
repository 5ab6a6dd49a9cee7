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
