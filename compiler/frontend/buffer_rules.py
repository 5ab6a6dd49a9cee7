"""How a stage's replicas combine the buffers the model's forward changes.

A stage's replicas each run some of an iteration's micro-batches (micro-batch m on replica m mod r), in
order, each from the buffers the iteration began with; the plain loop runs them all in one sequence. Where
the forward changes a buffer, the replicas must end the iteration with the plain loop's value. Per buffer
the forward changes (annotation's run found it changed), one rule:

- "average": batch norm's and instance norm's running statistics under a momentum α. Each micro-batch's
  update r <- (1-α)·r + α·s is affine, so the sequence ends at (1-α)^M·r0 + Σ_m (1-α)^(M-1-m)·α·s_m: a sum
  over the micro-batches, each weighted by its place, which the replicas' scatter-reduce adds exactly;
- "count": their batch counters, a sum of increments;
- "sequence": any other change (an average the forward also reads, a queue and its pointer, batch norm
  with momentum None, whose factor is the count): its value depends on the order, so its stage runs one
  replica (the planner's `BlockCost.sequenced`).
"""

from __future__ import annotations

import torch
from torch import fx, nn
from torch.nn.modules.batchnorm import _NormBase

from ...ir.graph import BufferRule
from .annotate import fetch_attr
from .trace import TracedProgram


def buffer_rules(model: nn.Module, program: TracedProgram, mutated: list[str]) -> dict[str, BufferRule]:
    """The rule of each buffer in `mutated` (the user model's names), by the module that owns it."""
    read_elsewhere = _read_outside_norms(program)
    rules: dict[str, BufferRule] = {}
    for name in mutated:
        owner_path, _, leaf = name.rpartition(".")
        try:
            owner = model.get_submodule(owner_path)
        except AttributeError:
            owner = None
        rule: BufferRule = BufferRule("sequence")
        if (
            isinstance(owner, _NormBase)
            and owner.track_running_stats
            and isinstance(owner.momentum, float)
            and not read_elsewhere & {f"{owner_path}.running_mean", f"{owner_path}.running_var"}
        ):
            if leaf in ("running_mean", "running_var"):
                rule = BufferRule("average", owner.momentum)
            elif leaf == "num_batches_tracked":
                rule = BufferRule("count")
        rules[name] = rule
    return dict(sorted(rules.items()))


def _read_outside_norms(program: TracedProgram) -> set[str]:
    """Buffers a get_attr node reads for anything but a normalisation op (whose running statistics they are)."""
    names: set[str] = set()
    for node in program.module.graph.nodes:
        if node.op != "get_attr":
            continue
        value = fetch_attr(program.module, str(node.target))
        if not isinstance(value, torch.Tensor):
            continue
        if any(not _is_norm(user) for user in node.users):
            names.add(program.tensor_name(value, str(node.target)))
    return names


def _is_norm(node: fx.Node) -> bool:
    name = getattr(node.target, "__name__", str(node.target))
    return node.op == "call_function" and ("batch_norm" in name or "instance_norm" in name)
