"""Values as bytes for storage: safetensors, with any non-tensor values in its JSON metadata.

Never pickle: a function reads these from storage another function wrote.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from safetensors.torch import load, save

_VALUES = "cloudless.values"


def pack(values: dict[str, Any]) -> bytes:
    """Tensors by name (detached, contiguous); ints, floats, bools, None and lists of them as JSON."""
    tensors = {name: v.detach().contiguous() for name, v in values.items() if isinstance(v, torch.Tensor)}
    others = {name: v for name, v in values.items() if not isinstance(v, torch.Tensor)}
    return save(tensors, metadata={_VALUES: json.dumps(others, sort_keys=True)})


def unpack(data: bytes) -> dict[str, Any]:
    tensors: dict[str, Any] = dict(load(data))
    header_size = int.from_bytes(data[:8], "little")
    metadata = json.loads(data[8 : 8 + header_size]).get("__metadata__") or {}
    tensors.update(json.loads(metadata.get(_VALUES, "{}")))
    return tensors
