"""Values as bytes for storage: safetensors, with any non-tensor values in its JSON metadata.

Never pickle: a function reads these from storage another function wrote.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from safetensors.torch import load, save

_VALUES = "cloudless.values"
#: the dtypes of tensors sent narrower than they are, by name: unpack gives them back in these
_WIDE = "cloudless.wide_dtypes"


def autocast(precision: str) -> torch.autocast:
    """The forward's and the loss's context under the run's precision: "bf16-mixed" as a plain loop's
    `with torch.autocast("cpu", dtype=torch.bfloat16)`; "32-true" no autocast."""
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed")


def wire_dtype(precision: str) -> torch.dtype | None:
    """The dtype activations and their gradients cross stages in: bfloat16 under "bf16-mixed"."""
    return torch.bfloat16 if precision == "bf16-mixed" else None


def pack(values: dict[str, Any], narrow: torch.dtype | None = None) -> bytes:
    """Tensors by name (detached, contiguous); ints, floats, bools, None and lists of them as JSON.
    With `narrow` (bfloat16 under mixed precision), floating tensors wider than it travel rounded to
    it, half the bytes, and unpack casts them back to their own dtype."""
    tensors = {name: v.detach().contiguous() for name, v in values.items() if isinstance(v, torch.Tensor)}
    others = {name: v for name, v in values.items() if not isinstance(v, torch.Tensor)}
    wide: dict[str, str] = {}
    if narrow is not None:
        for name, tensor in tensors.items():
            if tensor.is_floating_point() and tensor.element_size() > narrow.itemsize:
                wide[name] = str(tensor.dtype).removeprefix("torch.")
                tensors[name] = tensor.to(narrow)
    metadata = {_VALUES: json.dumps(others, sort_keys=True)}
    if wide:
        metadata[_WIDE] = json.dumps(wide, sort_keys=True)
    return save(tensors, metadata=metadata)


def unpack(data: bytes) -> dict[str, Any]:
    tensors: dict[str, Any] = dict(load(data))
    header_size = int.from_bytes(data[:8], "little")
    metadata = json.loads(data[8 : 8 + header_size]).get("__metadata__") or {}
    for name, dtype in json.loads(metadata.get(_WIDE, "{}")).items():
        wide = getattr(torch, dtype)
        if not isinstance(wide, torch.dtype) or not wide.is_floating_point:
            raise ValueError(f"{name}: sent narrowed from {dtype!r}, which is no floating dtype")
        tensors[name] = tensors[name].to(wide)
    tensors.update(json.loads(metadata.get(_VALUES, "{}")))
    return tensors
