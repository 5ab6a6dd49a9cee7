"""The Cloudless data model: op graph, block chain, and their JSON forms and schemas.

Imports nothing else of Cloudless; every other layer reads and writes these objects.
"""

from cloudless.ir.blocks import Block, BlockChain, MachineInfo
from cloudless.ir.graph import OpGraph, OpNode, ParamInfo, TensorMeta
from cloudless.ir.schema import SchemaError, load_schema, validate

API_VERSION = "cloudless/v1"

__all__ = [
    "API_VERSION",
    "Block",
    "BlockChain",
    "MachineInfo",
    "OpGraph",
    "OpNode",
    "ParamInfo",
    "SchemaError",
    "TensorMeta",
    "load_schema",
    "validate",
]
