"""The Cloudless data model: op graph, block chain, plan, workflow, the run contract, and their
JSON forms and schemas.

Imports nothing else of Cloudless; every other layer reads and writes these objects. This file
imports nothing itself, so that a function package can ship the few modules its runtime needs
(`workflow`, `schedule`, `protocol`: standard library and torch only) without the rest; the names
below load on first use.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from .workflow import API_VERSION

_LAZY = {
    "Block": "blocks",
    "BlockChain": "blocks",
    "MachineInfo": "blocks",
    "OpGraph": "graph",
    "OpNode": "graph",
    "ParamInfo": "graph",
    "TensorMeta": "graph",
    "SchemaError": "schema",
    "load_schema": "schema",
    "validate": "schema",
}

__all__ = ["API_VERSION", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(f"cloudless.ir.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'cloudless.ir' has no attribute {name!r}")
