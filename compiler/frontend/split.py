"""Split a traced program into pipeline stages at block cuts.

Stage s takes the values live across the cut before it and returns those live across the cut after
it (a skip connection passes through the stages it spans); the first stage takes the model's
inputs and the last returns the model's flat outputs. Each stage reads its own copy of the
parameters it uses, so a tied parameter used in two stages appears in both and its gradients are
summed.

`inline_leaf_modules` replaces the remaining `call_module` nodes by the ATen code torch.export
traces for them, so that the stage's source imports nothing but torch; a library module whose code
has no graph (library_modules.py) stays a call of the module, which the stage rebuilds.

A higher-order op (a `torch.no_grad()` or `torch.autocast` region, as torch.export keeps it) is one
node whose sub-graph modules are attributes read by get_attr nodes: a stage holds those it calls,
under the program's (or, inlined from a leaf, the leaf's path and) attribute name, and the stage's
source renders them as classes of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree

from ...codegen.stage_source import unsupported_higher_order_ops
from ...ir import OpGraph
from ..errors import CompileError
from .annotate import fetch_attr, node_tensors
from .coarsen import compute_positions, crossing_values
from .library_modules import is_data_dependent, is_library_class
from .trace import TracedProgram, export_module


@dataclass
class StagePart:
    """One pipeline stage as a runnable fx module, with the names of what it takes and returns."""

    index: int
    first_position: int
    last_position: int
    module: fx.GraphModule
    inputs: list[str]
    outputs: list[str]
    tensors: list[str]


def partition(program: TracedProgram, graph: OpGraph, cuts: list[int]) -> list[StagePart]:
    """Stages ending at each cut position (and the last at the end of the graph)."""
    positions = [n.name for n in compute_positions(graph)]
    position_of = {name: i for i, name in enumerate(positions)}
    if sorted(set(cuts)) != list(cuts) or any(not 0 <= c < len(positions) - 1 for c in cuts):
        raise ValueError(f"cuts {cuts} must be increasing positions in [0, {len(positions) - 2}]")
    crossing = crossing_values(graph, cuts)
    bounds = list(zip([-1, *cuts], [*cuts, len(positions) - 1], strict=True))
    output_args = program.output_node().args[0]
    parts = []
    for s, (before, last) in enumerate(bounds):
        inputs = program.input_names if s == 0 else crossing[s - 1]
        is_last = s == len(bounds) - 1
        outputs = [a.name if isinstance(a, fx.Node) else repr(a) for a in output_args] if is_last else crossing[s]
        stage_graph = fx.Graph()
        env: dict[str, fx.Node] = {name: stage_graph.placeholder(name) for name in inputs}
        source_nodes = {n.name: n for n in program.module.graph.nodes}

        attributes: dict[str, Any] = {}

        def lookup(
            node: fx.Node,
            env: dict[str, fx.Node] = env,
            stage_graph: fx.Graph = stage_graph,
            attributes: dict[str, Any] = attributes,
        ) -> fx.Node:
            if node.name not in env:
                if node.op != "get_attr":
                    raise CompileError(f"internal: value {node.name} is not available in its stage")
                value = fetch_attr(program.module, str(node.target))
                target = program.tensor_name(value, str(node.target))
                attributes[target] = value
                env[node.name] = stage_graph.create_node("get_attr", target, name=node.name)
            return env[node.name]

        for node in program.module.graph.nodes:
            position = position_of.get(node.name)
            if position is not None and before < position <= last:
                env[node.name] = stage_graph.node_copy(node, lookup)
                if node.op == "call_module":
                    attributes[str(node.target)] = program.module.get_submodule(str(node.target))
        if is_last:
            result = tuple(lookup(a) if isinstance(a, fx.Node) else a for a in output_args)
        else:
            result = tuple(lookup(source_nodes[name]) for name in outputs)
        stage_graph.output(result)
        for node in stage_graph.nodes:
            node.meta.pop("stack_trace", None)
        # A dict root: attributes live under the model's canonical names, whatever export called them.
        module = fx.GraphModule(attributes, stage_graph, f"Stage{s}")
        parts.append(
            StagePart(s, before + 1, last, module, list(inputs), list(outputs), _stage_tensors(module, program))
        )
    return parts


def _stage_tensors(module: fx.GraphModule, program: TracedProgram) -> list[str]:
    found: list[str] = []
    for node in module.graph.nodes:
        for tensor in node_tensors(module, node):
            name = program.tensor_name(tensor, str(node.target))
            if name not in found:
                found.append(name)
    return found


#: a leaf's export, or None for a library module that has no graph (it stays a call of the module)
_EXPORT_CACHE: dict[Any, tuple[fx.GraphModule, pytree.TreeSpec] | None] = {}


def inline_leaf_modules(part: StagePart, graph: OpGraph, program: TracedProgram) -> StagePart:
    """The same stage with every call_module node replaced by the leaf's exported ATen code."""
    module = part.module
    stage_graph = module.graph
    metas = {n.name: n for n in graph.nodes}
    leaves = [n for n in stage_graph.nodes if n.op == "call_module"]
    # Example arguments first: splicing one leaf renames the values the next one reads.
    examples = {
        node: pytree.tree_map_only(fx.Node, lambda n: _example_value(metas[n.name]), (node.args, node.kwargs))
        for node in leaves
    }
    for node in leaves:
        leaf = module.get_submodule(str(node.target))
        args, kwargs = examples[node]
        key = (
            type(leaf),
            repr(leaf),
            leaf.training,
            repr(pytree.tree_map_only(torch.Tensor, _meta_key, (args, kwargs))),
        )
        if key not in _EXPORT_CACHE:
            try:
                exported = export_module(leaf, tuple(args), dict(kwargs))
            except Exception as exc:
                if is_library_class(type(leaf)) and is_data_dependent(exc):
                    _EXPORT_CACHE[key] = None  # no graph: the stage runs the library's own code
                    continue
                raise CompileError(
                    f"module {node.target} ({type(leaf).__name__}) cannot be turned into torch-only code: "
                    f"torch.export failed ({type(exc).__name__}); leave it out of --leaf-module"
                ) from exc
            leaf_program = exported.module()
            for _, op in unsupported_higher_order_ops(leaf_program):
                raise CompileError(
                    f"module {node.target} ({type(leaf).__name__}) cannot be turned into torch-only code: "
                    f"torch.export turned it into torch.ops.higher_order.{op}; leave it out of --leaf-module"
                )
            spec = leaf_program.graph._codegen.pytree_info.out_spec
            _EXPORT_CACHE[key] = (leaf_program, spec)
        cached = _EXPORT_CACHE[key]
        if cached is None:
            continue
        leaf_program, out_spec = cached
        flat_args = pytree.tree_leaves((node.args, node.kwargs))
        placeholders = [n for n in leaf_program.graph.nodes if n.op == "placeholder"]
        if len(placeholders) != len(flat_args):
            raise CompileError(f"internal: cannot match the inputs of exported module {node.target}")
        env: dict[fx.Node, Any] = dict(zip(placeholders, flat_args, strict=True))
        existing = {n.target: n for n in stage_graph.nodes if n.op == "get_attr"}
        flat_out: list[Any] = []
        with stage_graph.inserting_before(node):
            for inner in leaf_program.graph.nodes:
                if inner.op == "placeholder" or (inner.op == "call_module" and inner.target == "_guards_fn"):
                    continue
                if inner.op == "get_attr":
                    tensor = fetch_attr(leaf_program, str(inner.target))
                    original = fetch_attr(leaf, str(inner.target)) if _has_attr(leaf, str(inner.target)) else tensor
                    target = program.tensor_name(original, f"{node.target}.{inner.target}")
                    if target not in existing:
                        if not _has_attr(module, target):
                            _set_attr(module, target, original)
                        existing[target] = stage_graph.get_attr(target)
                    env[inner] = existing[target]
                elif inner.op == "output":
                    flat_out = [env[a] if isinstance(a, fx.Node) else a for a in pytree.tree_leaves(inner.args[0])]
                else:
                    copied = stage_graph.node_copy(inner, env.__getitem__)
                    copied.meta.pop("stack_trace", None)
                    env[inner] = copied
            replacement = pytree.tree_unflatten(flat_out, out_spec)
            _replace_uses(stage_graph, node, replacement)
        stage_graph.erase_node(node)
    stage_graph.lint()
    rebuilt = fx.GraphModule(module, stage_graph, type(module).__name__)
    return replace(part, module=rebuilt)


def _replace_uses(graph: fx.Graph, node: fx.Node, replacement: Any) -> None:
    if isinstance(replacement, fx.Node):
        node.replace_all_uses_with(replacement)
        return
    for user in list(node.users):
        if user.op == "call_function" and user.target.__name__ == "getitem" and isinstance(user.args[1], int):
            user.replace_all_uses_with(replacement[user.args[1]])
            graph.erase_node(user)
    if node.users:
        with graph.inserting_before(next(iter(node.users))):
            packed = graph.call_function(type(replacement), (list(replacement),))
        node.replace_all_uses_with(packed)


def _example_value(meta: Any) -> Any:
    tensors = [torch.zeros(m.shape, dtype=getattr(torch, m.dtype)) for m in meta.outputs]
    if meta.value == "tensor":
        return tensors[0]
    if meta.value == "tensors":
        return tuple(tensors)
    raise CompileError(f"internal: leaf module input {meta.name} is not a tensor")


def _meta_key(t: torch.Tensor) -> tuple[Any, ...]:
    return (tuple(t.shape), str(t.dtype))


def _has_attr(module: torch.nn.Module, target: str) -> bool:
    try:
        fetch_attr(module, target)
    except AttributeError:
        return False
    return True


def _set_attr(module: torch.nn.Module, target: str, value: torch.Tensor) -> None:
    *path, name = target.split(".")
    owner = module
    for part in path:
        if not hasattr(owner, part):
            owner.add_module(part, torch.nn.Module())
        owner = getattr(owner, part)
    setattr(owner, name, value)
