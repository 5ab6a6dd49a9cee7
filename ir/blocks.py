"""The block chain: the op graph cut into a chain of blocks at points of its topological order.

Blocks are the planner's unit: a pipeline stage is a contiguous range of blocks.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .graph import dumps
from .schema import validate

BLOCKS_KIND = "BlockChain"


@dataclass
class MachineInfo:
    """The machine the block times were measured on, so later steps can scale them.

    `reference_gflops` is the measured fp32 matmul speed with `threads` threads; a function with a
    CPU share of s cores runs a block in about time * threads / s (compute-bound blocks).
    """

    reference_gflops: float
    threads: int
    cpu_count: int
    torch_version: str


@dataclass
class Block:
    """A contiguous range of op-graph nodes (by topological position, inclusive).

    `input_bytes`/`output_bytes` count every tensor live across the cut before/after the block,
    skip connections included. Times are the fastest of the timed runs (compiler/frontend/profile.py), in seconds.
    """

    index: int
    first: int
    last: int
    nodes: list[str]
    modules: list[str]
    flops: int
    param_bytes: int
    buffer_bytes: int
    saved_bytes: int
    input_bytes: int
    output_bytes: int
    params: list[str] = field(default_factory=list)
    forward_s: float = 0.0
    backward_s: float = 0.0

    @staticmethod
    def from_json(data: dict[str, Any]) -> Block:
        return Block(**data)


@dataclass
class ProfileStability:
    """How well the profile's repeated measurements agreed: what the compile warns from, never a
    planning input (compiler/frontend/profile.py defines the figures and the thresholds).

    `spread` and `reference_spread` are the relative gap between the two fastest timed runs of the
    whole chain, and between the two fastest reference matmuls; `cpu_share` is the CPU time the
    fastest reference matmul got over its wall time x its threads (1: the threads had their cores).
    """

    runs: int
    spread: float
    reference_spread: float
    cpu_share: float


@dataclass
class BlockChain:
    """The blocks of one model plus how their times were measured.

    `shared_params` maps a parameter used by more than one block to its byte size: each stage that
    uses it holds a copy, and the copies' gradients are summed.
    """

    model: str
    batch_size: int
    blocks: list[Block]
    shared_params: dict[str, int]
    machine: MachineInfo | None = None
    profile_repeats: int = 0
    #: None: not measured here (no profile, or one from before these figures were recorded)
    stability: ProfileStability | None = None
    #: buffers the forward changes in an order a stage's replicas cannot reproduce (buffer_rules.py: the
    #: "sequence" rule): a stage whose blocks read one runs one replica
    sequenced: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        document: dict[str, Any] = {
            "apiVersion": "cloudless/v1",
            "kind": BLOCKS_KIND,
            "model": self.model,
            "batch_size": self.batch_size,
            "profile_repeats": self.profile_repeats,
            "machine": asdict(self.machine) if self.machine else None,
            "shared_params": dict(self.shared_params),
            "blocks": [asdict(b) for b in self.blocks],
        }
        # Absent rather than null: an earlier blocks.json, loaded and saved again, stays byte-identical.
        if self.stability is not None:
            document["stability"] = asdict(self.stability)
        if self.sequenced:
            document["sequenced"] = list(self.sequenced)
        return document

    @staticmethod
    def from_json(data: dict[str, Any], source: str = "<blocks>") -> BlockChain:
        validate(data, "blocks", source)
        machine = data["machine"]
        return BlockChain(
            model=data["model"],
            batch_size=data["batch_size"],
            blocks=[Block.from_json(b) for b in data["blocks"]],
            shared_params=dict(data["shared_params"]),
            machine=MachineInfo(**machine) if machine else None,
            profile_repeats=data["profile_repeats"],
            stability=ProfileStability(**data["stability"]) if data.get("stability") else None,
            sequenced=list(data.get("sequenced", [])),
        )

    def save(self, path: Path) -> None:
        path.write_text(dumps(self.to_json()))

    @staticmethod
    def load(path: Path) -> BlockChain:
        return BlockChain.from_json(json.loads(path.read_text()), str(path))
