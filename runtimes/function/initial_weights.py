"""A stage's initial weights, as its function loads them at iteration 0.

A build holds them in the package's weights.safetensors; a staged build (a model beyond the compile's
weight threshold) holds only the stage's buffers and constants there, and the run puts its parameters
into storage first (staged_weights.py, `protocol.weights_key`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch
from safetensors.torch import load, load_file

from ...ir import protocol
from ...ir.workflow import Function


class Readable(Protocol):
    def get(self, key: str, timeout: float) -> bytes: ...


def package_weights(
    package: Path, function: Function, channel: Readable | None, namespace: str, timeout: float
) -> dict[str, torch.Tensor]:
    """The stage's initial tensors: its package's weights.safetensors and, for a staged build, the
    parameters the run staged (`channel`, the run's `namespace`)."""
    tensors = load_file(package / "weights.safetensors")
    if function.staged_parameters:
        if channel is None:
            raise ValueError(f"{function.name}: a staged build's weights are in the run's storage, and none is given")
        staged = load(channel.get(protocol.weights_key(namespace, function.name), timeout))
        missing = sorted(set(dict(function.staged_parameters)) - set(staged))
        if missing:
            raise ValueError(f"{function.name}: the staged weights lack {missing[0]!r}")
        tensors.update(staged)
    return tensors
