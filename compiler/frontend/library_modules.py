"""Library modules: a module of an installed library whose forward has no graph runs as its own code.

transformers' eager mixture of experts loops over the experts a batch hits: the loop count follows
tensor values, so neither torch.fx nor torch.export can trace it. When torch.export fails on such
data-dependent code inside a module whose class an installed package provides, every module of that
class becomes one opaque call: the export sees `torch.ops.cloudless.library_module_call`, whose outputs'
shapes come from one eager forward, and the program then calls the module itself (`call_module`).
Annotation and profiling run it eagerly, autograd included; the stage's source rebuilds it from its
class and attributes (codegen/library_objects.py) and the function installs the library.

A class of the model's own folder is not one: a function installs packages, not that folder.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from ...codegen.libraries import LibraryOpError, distribution_of

#: key -> the (shape, dtype) of each output of that call, for the op's fake kernel
_OUTPUTS: dict[str, list[tuple[torch.Size, torch.dtype]]] = {}


@torch.library.custom_op("cloudless::library_module_call", mutates_args=())
def library_module_call(key: str, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Stands for one call of a library module while torch.export traces; never run."""
    raise RuntimeError(f"internal: library module call {key} runs only as its module")


@library_module_call.register_fake
def _library_module_call_fake(key: str, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.empty(shape, dtype=dtype) for shape, dtype in _OUTPUTS[key]]


def is_library_class(cls: type) -> bool:
    """A class an installed package (not torch) provides: a function can import it by name."""
    module = getattr(cls, "__module__", "") or ""
    if module.split(".")[0] in ("torch", "builtins", "__main__") or module not in sys.modules:
        return False
    try:
        distribution_of(module)
    except LibraryOpError:
        return False
    return True


def is_data_dependent(exc: BaseException) -> bool:
    """torch.export (or fx) failed because code follows tensor values."""
    text = f"{type(exc).__name__}: {exc}"
    return "data-dependent" in text or "DataDependent" in text or "Proxy object cannot be iterated" in text


def failing_library_class(exc: BaseException, model: nn.Module) -> type | None:
    """The class of the innermost module of `model`, provided by an installed library, whose forward
    was running when `exc` (a data-dependent failure) was raised; None if there is none."""
    if not is_data_dependent(exc):
        return None
    modules = {id(m) for m in model.modules()}
    found: type | None = None
    tb = exc.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and id(owner) in modules and is_library_class(type(owner)):
            found = type(owner)
        tb = tb.tb_next
    return found


@dataclass
class _Call:
    """One call of a library module during the export: where, with what, returning what."""

    path: str
    in_spec: pytree.TreeSpec
    #: the arguments' leaves, tensors replaced by None (they are the op's inputs, in order)
    constants: list[Any]
    out_spec: pytree.TreeSpec


@dataclass
class LibraryCalls:
    """The library modules of an export, and each of their calls."""

    modules: dict[str, nn.Module] = field(default_factory=dict)
    calls: dict[str, _Call] = field(default_factory=dict)


@contextmanager
def opaque_library_modules(
    model: nn.Module, example_inputs: tuple[Any, ...], classes: list[type]
) -> Iterator[LibraryCalls]:
    """While open, each module of `model` of one of `classes` is one op for torch.export."""
    found = LibraryCalls({name: m for name, m in model.named_modules() if type(m) in classes})
    if not found.modules:
        yield found
        return
    recorded: dict[str, list[Any]] = {}
    hooks = [
        module.register_forward_hook(lambda _m, _a, out, path=path: recorded.setdefault(path, []).append(out))
        for path, module in found.modules.items()
    ]
    try:
        with torch.no_grad():
            model(*example_inputs)
    finally:
        for hook in hooks:
            hook.remove()
    counts: dict[str, int] = {}

    def opaque(path: str) -> Any:
        def forward(*args: Any, **kwargs: Any) -> Any:
            index = counts.get(path, 0)
            counts[path] = index + 1
            key = f"{path}#{index}"
            leaves, in_spec = pytree.tree_flatten((args, kwargs))
            outputs, out_spec = pytree.tree_flatten(recorded[path][index])
            if not all(isinstance(o, torch.Tensor) for o in outputs):
                raise TypeError(f"library module {path} returns values that are not tensors")
            _OUTPUTS[key] = [(o.shape, o.dtype) for o in outputs]
            found.calls[key] = _Call(
                path, in_spec, [None if isinstance(v, torch.Tensor) else v for v in leaves], out_spec
            )
            result = library_module_call(key, [v for v in leaves if isinstance(v, torch.Tensor)])
            return pytree.tree_unflatten(list(result), out_spec)

        return forward

    for path, module in found.modules.items():
        module.forward = opaque(path)
    try:
        yield found
    finally:
        for module in found.modules.values():
            del module.forward


def call_library_modules(module: fx.GraphModule, found: LibraryCalls) -> None:
    """Turn each `library_module_call` node of the exported `module` into a call of its module (put
    into `module` at its path in the model)."""
    graph = module.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.cloudless.library_module_call.default:
            continue
        call = found.calls[str(node.args[0])]
        tensors = iter(node.args[1])
        leaves = [next(tensors) if v is None else v for v in call.constants]
        args, kwargs = pytree.tree_unflatten(leaves, call.in_spec)
        with graph.inserting_before(node):
            result = graph.call_module(call.path, tuple(args), dict(kwargs))
        outputs = [user for user in node.users]
        if call.out_spec.num_leaves == 1 and call.out_spec.is_leaf():
            for user in outputs:
                user.replace_all_uses_with(result)
                graph.erase_node(user)
        elif call.out_spec.type in (tuple, list) and all(c.is_leaf() for c in call.out_spec.children()):
            for user in outputs:
                user.args = (result, user.args[1])
        else:
            raise TypeError(f"library module {call.path} returns a structure other than a tensor or a tuple of them")
        graph.erase_node(node)
    for path, library in found.modules.items():
        *parents, leaf = path.split(".")
        owner: nn.Module = module
        for part in parents:
            if part not in owner._modules:
                owner.add_module(part, nn.Module())
            owner = owner._modules[part]  # type: ignore[assignment]
        owner._modules[leaf] = library
    graph.lint()
    module.recompile()


def library_calls_left(module: nn.Module) -> bool:
    """Whether a sub-graph (a region torch.export kept) still calls a library module as the op."""
    for sub in module.modules():
        graph = getattr(sub, "graph", None)
        if isinstance(graph, fx.Graph) and any(
            n.target is torch.ops.cloudless.library_module_call.default for n in graph.nodes
        ):
            return True
    return False
