"""Keep a model's buffers (BatchNorm running statistics and the like) as the user built them.

The front end runs the model several times; those runs must not leak into the weights it ships.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache

import torch
from torch import nn


@contextmanager
def preserved_state(*modules: nn.Module) -> Iterator[None]:
    """Restore every buffer's value and every module's training flag on exit."""
    saved = [
        (
            module,
            {name: b.detach().clone() for name, b in module.named_buffers()},
            {name: m.training for name, m in module.named_modules()},
        )
        for module in modules
    ]
    try:
        yield
    finally:
        with torch.no_grad():
            for module, buffers, modes in saved:
                for name, buffer in module.named_buffers():
                    if name in buffers:
                        buffer.copy_(buffers[name])
                for name, m in module.named_modules():
                    m.train(modes.get(name, m.training))


@cache
def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:  # not glibc: nothing to trim
        return None


def release_free_memory() -> None:
    """Give the memory the allocator holds free back to the system (glibc's malloc_trim): a big model's
    forward frees gigabytes of activations in pieces the heap would otherwise keep, and the next step's
    peak would count them again."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
