"""Run a chain of stages forward, then backward, passing values and gradients by name.

This is what a pipeline does with one micro-batch, done in one process: each stage receives its
inputs as fresh leaf tensors (as if read from storage), and each stage's backward starts from the
gradients the next stage computed for those inputs. Profiling (one stage per block) and
verification (the generated stages) both run through here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class ChainRun:
    loss: torch.Tensor
    outputs: tuple[Any, ...]
    forward_s: list[float] = field(default_factory=list)
    backward_s: list[float] = field(default_factory=list)


def _receive(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex()):
        return value.detach().requires_grad_(True)
    if isinstance(value, torch.Tensor):
        return value.detach()
    return value


def run_chain(
    stages: Sequence[Callable[..., tuple[Any, ...]]],
    signatures: Sequence[tuple[Sequence[str], Sequence[str]]],
    model_inputs: dict[str, Any],
    loss_of: Callable[[tuple[Any, ...]], torch.Tensor],
) -> ChainRun:
    """Forward through every stage, compute the loss from the last stage's outputs, backward."""
    values: dict[str, Any] = dict(model_inputs)
    received: list[dict[str, Any]] = []
    produced: list[tuple[Any, ...]] = []
    forward_s: list[float] = []
    for s, (stage, (inputs, outputs)) in enumerate(zip(stages, signatures, strict=True)):
        taken = {name: (values[name] if s == 0 else _receive(values[name])) for name in inputs}
        start = time.perf_counter()
        result = tuple(stage(*[taken[name] for name in inputs]))
        if s == len(stages) - 1:
            loss = loss_of(result)
        forward_s.append(time.perf_counter() - start)
        received.append(taken)
        produced.append(result)
        if s < len(stages) - 1:
            values = dict(zip(outputs, result, strict=True))

    backward_s = [0.0] * len(stages)
    start = time.perf_counter()
    loss.backward()
    backward_s[-1] = time.perf_counter() - start
    for s in range(len(stages) - 2, -1, -1):
        next_inputs = received[s + 1]
        tensors, grads = [], []
        for name, value in zip(signatures[s][1], produced[s], strict=True):
            grad = getattr(next_inputs.get(name), "grad", None)
            if isinstance(value, torch.Tensor) and value.requires_grad and grad is not None:
                tensors.append(value)
                grads.append(grad)
        start = time.perf_counter()
        if tensors:
            torch.autograd.backward(tensors, grads)
        backward_s[s] = time.perf_counter() - start
    return ChainRun(loss.detach(), produced[-1], forward_s, backward_s)
