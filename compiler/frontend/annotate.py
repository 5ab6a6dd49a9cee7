"""Annotate every node of a traced program by running it once on the example inputs.

Per node: output shapes and dtypes, output bytes, the parameters it uses (a shared or tied
parameter is owned by its first user, so it is counted once, in its own dtype), the activation
bytes autograd saves for backward (parameters excluded, each storage counted once), forward FLOPs
(torch's FlopCounterMode: matmul, convolution and attention; elementwise ops count 0), and which
inputs it mutates in place; and which of the program's buffers the run changed.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch import fx
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree
from torch.utils.flop_counter import FlopCounterMode

from ...ir import OpGraph, OpNode, ParamInfo, TensorMeta
from .trace import TracedProgram, module_path


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_bytes(value: Any) -> int:
    """Bytes of every tensor inside `value` (tuples, lists and dicts included)."""
    return sum(t.numel() * t.element_size() for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor))


def value_kind(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return "tensor"
    if value is None:
        return "none"
    if isinstance(value, tuple | list) and value and all(isinstance(v, torch.Tensor) for v in value):
        return "tensors"
    return "other"


def fetch_attr(module: torch.nn.Module, target: str) -> Any:
    value: Any = module
    for part in target.split("."):
        value = getattr(value, part)
    return value


def node_tensors(module: fx.GraphModule, node: fx.Node) -> list[torch.Tensor]:
    """The parameters and buffers a get_attr or call_module node reads."""
    if node.op == "get_attr":
        value = fetch_attr(module, str(node.target))
        return [value] if isinstance(value, torch.Tensor) else []
    if node.op == "call_module":
        sub = module.get_submodule(str(node.target))
        return [*sub.parameters(), *sub.buffers()]
    return []


class _SavedBytes:
    """The pack hook's bookkeeping: the bytes of the activations autograd saves, per node, each storage
    counted once while it lives. Kept apart from the interpreter: the saved values hold the hook, and a
    hook holding the interpreter (its values, the graph's outputs) would be a cycle through C++ no
    collector sees.

    Nothing is kept for a backward (annotation's run is never differentiated): a saved activation lives
    as long as the run uses it, not until the run ends, so the run's memory follows its largest layer, not
    the model (a 70B shape's 80 layers kept ~110 MB each). Storages are told apart by address and a weak
    reference: an address a freed storage had counts again for the next storage there."""

    def __init__(self, param_storages: set[int]) -> None:
        self.param_storages = param_storages
        self.current = ""
        self.seen_storages: dict[int, StorageWeakRef] = {}
        self.saved: dict[str, int] = defaultdict(int)

    def pack(self, t: torch.Tensor) -> int:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        seen = self.seen_storages.get(key)
        if key not in self.param_storages and (seen is None or seen.expired()):
            self.seen_storages[key] = StorageWeakRef(storage)
            self.saved[self.current] += storage.nbytes()
        return key

    @staticmethod
    def unpack(key: int) -> torch.Tensor:
        raise RuntimeError("annotation's run keeps no saved tensors: it cannot be differentiated")


class _Annotator(fx.Interpreter):
    def __init__(self, module: fx.GraphModule, param_storages: set[int]) -> None:
        super().__init__(module)
        self.saved_bytes = _SavedBytes(param_storages)
        self.flops: dict[str, int] = {}
        self.mutates: dict[str, list[str]] = {}
        self.results: dict[str, Any] = {}

    @property
    def saved(self) -> dict[str, int]:
        return self.saved_bytes.saved

    def run_node(self, n: fx.Node) -> Any:
        versions = {
            (inp.name, i): t._version
            for inp in n.all_input_nodes
            for i, t in enumerate(pytree.tree_leaves(self.env.get(inp)))
            if isinstance(t, torch.Tensor)
        }
        self.saved_bytes.current = n.name
        with self._set_current_node(n):
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            with FlopCounterMode(display=False) as counter:
                result = getattr(self, n.op)(n.target, args, kwargs)
        self.flops[n.name] = int(counter.get_total_flops())
        changed = []
        for inp in n.all_input_nodes:
            leaves = pytree.tree_leaves(self.env.get(inp))
            if any(
                isinstance(t, torch.Tensor) and versions.get((inp.name, i)) != t._version for i, t in enumerate(leaves)
            ):
                changed.append(inp.name)
        self.mutates[n.name] = changed
        self.results[n.name] = _describe_value(result)
        return result


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN equal to NaN (a buffer of NaNs the run left alone is unchanged)."""
    if a.is_floating_point() or a.is_complex():
        return bool(torch.allclose(a, b, rtol=0, atol=0, equal_nan=True))
    return torch.equal(a, b)


def _describe_value(value: Any) -> tuple[str, list[TensorMeta], int]:
    metas = [
        TensorMeta(tuple(int(d) for d in t.shape), dtype_name(t.dtype))
        for t in pytree.tree_leaves(value)
        if isinstance(t, torch.Tensor)
    ]
    return value_kind(value), metas, tensor_bytes(value)


def annotate(program: TracedProgram, flat_inputs: list[Any], model_name: str, batch_size: int) -> OpGraph:
    """Run the program once (with autograd on, so saved activations are real) and record per node."""
    return annotate_run(program, flat_inputs, model_name, batch_size)[0]


def annotate_run(
    program: TracedProgram, flat_inputs: list[Any], model_name: str, batch_size: int
) -> tuple[OpGraph, tuple[Any, ...]]:
    """`annotate`, and the program's flat outputs of that run, detached: a big model's forward is the
    dearest step of a front end, and what checks the loss and writes the loss module needs them too."""
    module = program.module
    names = program.tensor_names
    param_storages = {t.untyped_storage().data_ptr() for t in [*module.parameters(), *module.buffers()]}
    annotator = _Annotator(module, param_storages)
    saved = annotator.saved_bytes
    # what the run leaves changed among the buffers (by value, or in place: batch norm's kernel updates its
    # running statistics without their version counting it)
    before = {
        program.tensor_name(b, name): (b, b.detach().clone(), b._version)
        for name, b in module.named_buffers()
        if not b.is_meta
    }
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
        outputs = annotator.run(*flat_inputs)
    mutated = sorted(
        name for name, (b, value, version) in before.items() if b._version != version or not _same(b, value)
    )
    del before
    flat_outputs = tuple(o.detach() if isinstance(o, torch.Tensor) else o for o in outputs)
    del outputs

    parameters: dict[str, ParamInfo] = {}
    nodes: list[OpNode] = []
    for node in module.graph.nodes:
        kind, metas, nbytes = annotator.results.get(node.name, ("none", [], 0))
        used: list[str] = []
        owned_params = owned_buffers = 0
        for tensor in node_tensors(module, node):
            name, trainable = names.get(id(tensor), (str(node.target), False))
            if name in used:
                continue
            used.append(name)
            if name not in parameters:
                size = tensor.numel() * tensor.element_size()
                parameters[name] = ParamInfo(tuple(tensor.shape), dtype_name(tensor.dtype), size, trainable)
                if trainable:
                    owned_params += size
                else:
                    owned_buffers += size
        inputs = [i.name for i in node.all_input_nodes]
        if node.op == "output":
            inputs = [a.name for a in node.args[0] if isinstance(a, fx.Node)]
        nodes.append(
            OpNode(
                name=node.name,
                op=node.op,
                target=_target_name(node),
                module=module_path(node),
                value=kind,
                inputs=inputs,
                outputs=metas,
                output_bytes=nbytes,
                params=used,
                param_bytes=owned_params,
                buffer_bytes=owned_buffers,
                saved_bytes=annotator.saved.get(node.name, 0),
                flops=annotator.flops.get(node.name, 0),
                mutates=annotator.mutates.get(node.name, []),
            )
        )
    output = program.output_node()
    graph = OpGraph(
        model=model_name,
        tracer=program.tracer,
        batch_size=batch_size,
        nodes=nodes,
        inputs=program.input_names,
        outputs=[a.name if isinstance(a, fx.Node) else repr(a) for a in output.args[0]],
        parameters=dict(sorted(parameters.items())),
        state_names=dict(program.state_names),
        mutated_buffers=mutated,
    )
    return graph, flat_outputs


def _target_name(node: fx.Node) -> str:
    target = node.target
    if isinstance(target, str):
        return target
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    module = getattr(target, "__module__", None) or ""
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", repr(target))
    return f"{module}.{name}" if module else str(name)
