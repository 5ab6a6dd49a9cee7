"""The op graph: one node per traced operation, annotated with shapes, bytes and FLOPs.

Nodes are kept in topological (execution) order; the networkx DiGraph holds the data edges.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import networkx as nx

from .schema import validate

GRAPH_KIND = "OpGraph"


@dataclass(frozen=True)
class TensorMeta:
    """Shape and dtype of one tensor a node produces."""

    shape: tuple[int, ...]
    dtype: str

    def to_json(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "dtype": self.dtype}

    @staticmethod
    def from_json(data: dict[str, Any]) -> TensorMeta:
        return TensorMeta(tuple(data["shape"]), data["dtype"])


@dataclass
class OpNode:
    """One traced operation.

    `op` is the fx opcode (placeholder, get_attr, call_function, call_method, call_module, output);
    `params` the parameters it owns (a parameter shared by several nodes is owned by the first);
    `saved_bytes` the activation bytes autograd keeps for backward (parameters excluded);
    `mutates` the inputs it changes in place; `value` what it produces: "tensor", "tensors" (a
    tuple or list of tensors), "none" or "other" (Python values such as sizes).
    """

    name: str
    op: str
    target: str
    module: str = ""
    value: str = "tensor"
    inputs: list[str] = field(default_factory=list)
    outputs: list[TensorMeta] = field(default_factory=list)
    output_bytes: int = 0
    params: list[str] = field(default_factory=list)
    param_bytes: int = 0
    buffer_bytes: int = 0
    saved_bytes: int = 0
    flops: int = 0
    mutates: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["outputs"] = [m.to_json() for m in self.outputs]
        return data

    @staticmethod
    def from_json(data: dict[str, Any]) -> OpNode:
        fields = dict(data)
        fields["outputs"] = [TensorMeta.from_json(m) for m in data["outputs"]]
        return OpNode(**fields)


@dataclass(frozen=True)
class ParamInfo:
    """One parameter or buffer, under its canonical (first) name; tied names share one entry."""

    shape: tuple[int, ...]
    dtype: str
    bytes: int
    trainable: bool

    def to_json(self) -> dict[str, Any]:
        return {
            "shape": list(self.shape),
            "dtype": self.dtype,
            "bytes": self.bytes,
            "trainable": self.trainable,
        }

    @staticmethod
    def from_json(data: dict[str, Any]) -> ParamInfo:
        return ParamInfo(tuple(data["shape"]), data["dtype"], data["bytes"], data["trainable"])


@dataclass(frozen=True)
class BufferRule:
    """How a stage's replicas combine a buffer the forward changes (compiler/frontend/buffer_rules.py):
    "average" (running statistics under `momentum`), "count", or "sequence" (its stage runs one replica)."""

    rule: Literal["average", "count", "sequence"]
    momentum: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {"rule": self.rule} if self.momentum is None else {"rule": self.rule, "momentum": self.momentum}

    @staticmethod
    def from_json(data: dict[str, Any]) -> BufferRule:
        return BufferRule(data["rule"], data.get("momentum"))


@dataclass
class OpGraph:
    """The annotated op graph of one model, as traced for one micro-batch size."""

    model: str
    tracer: str
    batch_size: int
    nodes: list[OpNode]
    inputs: list[str]
    outputs: list[str]
    parameters: dict[str, ParamInfo] = field(default_factory=dict)
    #: the user model's state_dict keys -> the names the stages hold their tensors under (a tied
    #: weight's every name; non-persistent buffers absent): what the trained model file is keyed by
    state_names: dict[str, str] = field(default_factory=dict)
    #: the buffers annotation's run of the forward changed (the user model's names), and how replicas
    #: combine each (set by the buffer_rules pass)
    mutated_buffers: list[str] = field(default_factory=list)
    buffer_rules: dict[str, BufferRule] = field(default_factory=dict)

    @property
    def digraph(self) -> nx.DiGraph:
        """The data-dependency graph; node attributes are the OpNode objects under key "node"."""
        graph = nx.DiGraph()
        for node in self.nodes:
            graph.add_node(node.name, node=node)
        for node in self.nodes:
            for source in node.inputs:
                graph.add_edge(source, node.name)
        return graph

    def node(self, name: str) -> OpNode:
        return self._by_name()[name]

    def _by_name(self) -> dict[str, OpNode]:
        return {n.name: n for n in self.nodes}

    @property
    def param_bytes(self) -> int:
        return sum(p.bytes for p in self.parameters.values() if p.trainable)

    @property
    def param_count(self) -> int:
        total = 0
        for p in self.parameters.values():
            if p.trainable:
                count = 1
                for d in p.shape:
                    count *= d
                total += count
        return total

    @property
    def flops(self) -> int:
        return sum(n.flops for n in self.nodes)

    def to_json(self) -> dict[str, Any]:
        return {
            "apiVersion": "cloudless/v1",
            "kind": GRAPH_KIND,
            "model": self.model,
            "tracer": self.tracer,
            "batch_size": self.batch_size,
            "inputs": list(self.inputs),
            "outputs": list(self.outputs),
            "parameters": {k: v.to_json() for k, v in self.parameters.items()},
            "state_names": dict(self.state_names),
            "nodes": [n.to_json() for n in self.nodes],
            # absent when empty: the graphs of models without such buffers stay as they were
            **({"buffer_rules": {k: r.to_json() for k, r in self.buffer_rules.items()}} if self.buffer_rules else {}),
        }

    @staticmethod
    def from_json(data: dict[str, Any], source: str = "<graph>") -> OpGraph:
        validate(data, "graph", source)
        return OpGraph(
            model=data["model"],
            tracer=data["tracer"],
            batch_size=data["batch_size"],
            nodes=[OpNode.from_json(n) for n in data["nodes"]],
            inputs=list(data["inputs"]),
            outputs=list(data["outputs"]),
            parameters={k: ParamInfo.from_json(v) for k, v in data["parameters"].items()},
            state_names=dict(data.get("state_names", {})),
            mutated_buffers=list(data.get("buffer_rules", {})),
            buffer_rules={k: BufferRule.from_json(v) for k, v in data.get("buffer_rules", {}).items()},
        )

    def save(self, path: Path) -> None:
        path.write_text(dumps(self.to_json()))

    @staticmethod
    def load(path: Path) -> OpGraph:
        return OpGraph.from_json(json.loads(path.read_text()), str(path))


def dumps(document: Any) -> str:
    """The one JSON form of every IR file: sorted keys, two-space indent, trailing newline."""
    return json.dumps(document, indent=2, sort_keys=True) + "\n"
