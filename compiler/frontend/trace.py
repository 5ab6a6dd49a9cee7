"""Trace a model into a flat fx program: torch.fx first, torch.export (non-strict) where fx fails.

The program's placeholders are the flattened example inputs and its output is a flat tuple; the
pytree spec to rebuild the model's (possibly structured) output is kept beside it.

torch.fx records no grad mode or autocast state: a `torch.no_grad()` or `torch.autocast(...)`
region of the model's forward would run without it in the stages. The fx tracer therefore refuses
code traced in any other mode than the trace's start, and the model goes to torch.export, which
keeps such regions as higher-order ops over sub-graphs (`wrap_with_set_grad_enabled`,
`wrap_with_autocast`). Any other higher-order op is a TraceFailure naming the model's line and
module: control flow (`torch.cond`, `map`, `while_loop`, `scan`) too, which stage code could hold,
but which annotation cannot run (see TRACEABLE_HIGHER_ORDER_OPS).
"""

from __future__ import annotations

import inspect
import io
import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import fx, nn
from torch.fx.graph import CodeGen
from torch.utils import _pytree as pytree

from ...codegen.stage_source import CALL_OPS, REGION_OPS, unsupported_higher_order_ops
from ..errors import (
    _LIBRARY_MARKERS,
    TraceFailure,
    describe,
    display_path,
    frame_location,
    frame_source,
    user_frame,
)
from .library_modules import call_library_modules, failing_library_class, library_calls_left, opaque_library_modules

TracerName = Literal["fx", "export"]

#: The higher-order ops a traced program may hold: the grad-mode and autocast regions. The control
#: flow ops (CALL_OPS) render, but annotation cannot run them yet: torch runs them eagerly by tracing
#: their branches' autograd, which breaks under its FLOP counter and saved-tensor hooks.
TRACEABLE_HIGHER_ORDER_OPS = frozenset(REGION_OPS)


@dataclass
class TracedProgram:
    """A flat fx program equivalent to the model's forward on the example inputs."""

    module: fx.GraphModule
    out_spec: pytree.TreeSpec
    tracer: TracerName
    fx_error: str = ""
    #: id(tensor held by `module`) -> (the user model's name for it, trainable: a parameter the model does
    #: not freeze). torch.export may
    #: register a tied weight under its second name; everything downstream uses the model's first.
    tensor_names: dict[int, tuple[str, bool]] = field(default_factory=dict)
    #: every key of the user model's state_dict -> the name its tensor has downstream (a tied
    #: weight's second name -> its first); non-persistent buffers are not keys
    state_names: dict[str, str] = field(default_factory=dict)

    def tensor_name(self, tensor: torch.Tensor, fallback: str) -> str:
        return self.tensor_names.get(id(tensor), (fallback, False))[0]

    @property
    def input_names(self) -> list[str]:
        return [n.name for n in self.module.graph.nodes if n.op == "placeholder"]

    def output_node(self) -> fx.Node:
        return next(n for n in reversed(self.module.graph.nodes) if n.op == "output")


class RegionNotTraceable(Exception):
    """Code under another grad mode or autocast state than the trace's: fx would drop the region."""


def _modes() -> tuple[Any, ...]:
    """The state torch.fx does not record: grad mode, inference mode and autocast."""
    return (
        torch.is_grad_enabled(),
        torch.is_inference_mode_enabled(),
        *((torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")),
    )


def _region(start: tuple[Any, ...], now: tuple[Any, ...]) -> str:
    if now[0] != start[0]:
        return "torch.enable_grad()" if now[0] else "torch.no_grad()"
    return "torch.inference_mode()" if now[1] != start[1] else "torch.autocast(...)"


class InliningTracer(fx.Tracer):
    """Traces through every module, torch.nn ones included, so the graph is functional code.

    Modules named as leaves stay single `call_module` nodes; so does a torch.nn module whose
    forward fx cannot trace (BatchNorm checks `input.dim()`), found by trying and rolling back.
    A node traced under another grad mode or autocast state than the trace's start raises
    RegionNotTraceable: the graph cannot say so.
    """

    def __init__(self, leaf_modules: Sequence[str] = ()) -> None:
        super().__init__()
        self.leaf_modules = set(leaf_modules)
        self._force_leaf = False
        self._param_cache: dict[str, Any] = {}
        self._modes = _modes()

    def create_node(self, kind: str, target: Any, args: Any, kwargs: Any, *rest: Any, **options: Any) -> fx.Node:
        now = _modes()
        if now != self._modes:
            raise RegionNotTraceable(f"torch.fx cannot keep the {_region(self._modes, now)} region of the forward")
        return super().create_node(kind, target, args, kwargs, *rest, **options)

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return self._force_leaf or _is_named_leaf(m, module_qualified_name, self.leaf_modules)

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict[str, Any]) -> Any:
        # Our own cache, so that a rolled-back inline attempt can forget the proxies it made.
        return super().getattr(attr, attr_val, self._param_cache)

    def call_module(self, m: nn.Module, forward: Any, args: tuple, kwargs: dict) -> Any:
        if not type(m).__module__.startswith("torch.nn") or self.is_leaf_module(m, self.path_of_module(m)):
            return super().call_module(m, forward, args, kwargs)
        before = list(self.graph.nodes)
        saved_stack = dict(self.module_stack)
        saved_cache = dict(self._param_cache)
        try:
            return super().call_module(m, forward, args, kwargs)
        except (fx.proxy.TraceError, TypeError, RuntimeError, AttributeError):
            known = set(before)
            for node in reversed(list(self.graph.nodes)):
                if node not in known:
                    self.graph.erase_node(node)
            self.module_stack.clear()
            self.module_stack.update(saved_stack)
            self._param_cache = saved_cache
            self._force_leaf = True
            try:
                return super().call_module(m, forward, args, kwargs)
            finally:
                self._force_leaf = False


def _is_named_leaf(m: nn.Module, qualified_name: str, names: set[str]) -> bool:
    cls = type(m)
    return bool(names & {cls.__name__, f"{cls.__module__}.{cls.__qualname__}", qualified_name})


def trace_model(
    model: nn.Module,
    example_inputs: tuple[Any, ...],
    *,
    model_path: Path,
    leaf_modules: Sequence[str] = (),
    tracer: Literal["auto", "fx", "export"] = "auto",
) -> TracedProgram:
    """Trace `model` on `example_inputs`; raise TraceFailure naming the user's line if nothing works."""
    fx_exc: BaseException | None = None
    if tracer in ("auto", "fx"):
        try:
            program = _trace_fx(model, example_inputs, leaf_modules)
            if tracer == "fx" or _agrees_with_eager(program, model, example_inputs):
                program.tensor_names = _model_names(program.module, model)
                program.state_names = _state_names(model)
                return program
            fx_exc = RuntimeError("the fx graph's outputs differ from the model's (Python control flow was baked in)")
        except Exception as exc:  # noqa: BLE001 - fx failing is expected; export is the fallback
            fx_exc = exc
        if tracer == "fx":
            raise _trace_failure(model_path, fx_exc, None) from fx_exc
    library: list[type] = []  # classes whose modules run as the library's code (data-dependent loops)
    while True:
        try:
            program = _trace_export(model, example_inputs, library)
            break
        except Exception as exc:
            found = failing_library_class(exc, model)
            if found is None or found in library:
                raise _trace_failure(model_path, fx_exc, exc) from exc
            library.append(found)
    for node, op in unsupported_higher_order_ops(program.module, TRACEABLE_HIGHER_ORDER_OPS):
        raise _higher_order_failure(model_path, node, op)
    if any(n.target is torch.ops.higher_order.wrap_with_autocast for n in program.module.graph.nodes):
        _check_autocast_gradients(program, model, example_inputs, model_path)
    program.fx_error = describe(fx_exc) if fx_exc else ""
    program.tensor_names = _model_names(program.module, model)
    program.state_names = _state_names(model)
    return program


def _memory(t: torch.Tensor) -> tuple[Any, ...]:
    # the storage itself, not its address: a model built on the meta device has none
    return (t.untyped_storage()._cdata, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def _state_names(model: nn.Module) -> dict[str, str]:
    """The model's state_dict keys, each with the first name of its tensor (what the stages hold)."""
    first: dict[tuple[Any, ...], str] = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.numel():
            first.setdefault(_memory(t), name)
    return {
        key: first.get(_memory(t), key) if t.numel() else key for key, t in model.state_dict(keep_vars=True).items()
    }


def _model_names(module: torch.fx.GraphModule, model: nn.Module) -> dict[int, tuple[str, bool]]:
    """Name each tensor of the traced module by the user model's first name for the same memory."""

    key = _memory
    by_memory: dict[tuple[Any, ...], tuple[str, bool]] = {}
    for name, p in model.named_parameters():
        by_memory.setdefault(key(p), (name, p.requires_grad))  # a frozen parameter is not trained
    for name, b in model.named_buffers():
        by_memory.setdefault(key(b), (name, False))
    names: dict[int, tuple[str, bool]] = {}
    for name, t in [
        *module.named_parameters(remove_duplicate=False),
        *module.named_buffers(remove_duplicate=False),
    ]:
        if id(t) not in names:
            found = by_memory.get(key(t)) if t.numel() else None
            names[id(t)] = found or (name, isinstance(t, nn.Parameter) and t.requires_grad)
    for node in module.graph.nodes:  # lifted constants are attributes, not buffers
        if node.op == "get_attr":
            value = module
            for part in str(node.target).split("."):
                value = getattr(value, part)
            if isinstance(value, torch.Tensor) and id(value) not in names:
                names[id(value)] = (str(node.target), False)
    return names


def _trace_fx(model: nn.Module, example_inputs: tuple[Any, ...], leaf_modules: Sequence[str]) -> TracedProgram:
    if not all(isinstance(x, torch.Tensor) for x in example_inputs):
        raise TypeError("fx tracing here takes tensor inputs only; structured inputs go through torch.export")
    parameters = list(inspect.signature(model.forward).parameters.values())
    concrete = {
        p.name: p.default for p in parameters[len(example_inputs) :] if p.default is not inspect.Parameter.empty
    }
    tracer = InliningTracer(leaf_modules)
    graph = tracer.trace(model, concrete_args=concrete or None)
    module = fx.GraphModule(tracer.root, graph, type(model).__name__)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for node in placeholders[len(example_inputs) :]:
        # Arguments fixed by concrete_args leave placeholders fx never reads; drop them.
        if not node.users:
            graph.erase_node(node)
    return _flatten_output(module, "fx")


@contextmanager
def quiet_torch_logs() -> Iterator[None]:
    """torch.export logs graphs and warnings when it fails; the user gets our one message instead."""
    logger = logging.getLogger("torch")
    level, propagate = logger.level, logger.propagate
    logger.setLevel(logging.CRITICAL)
    logger.propagate = False
    try:
        with redirect_stdout(io.StringIO()), redirect_stderr(io.StringIO()):
            yield
    finally:
        logger.setLevel(level)
        logger.propagate = propagate


def export_module(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> Any:
    """torch.export.export, non-strict, with its logging silenced."""
    with quiet_torch_logs():
        return torch.export.export(module, args, kwargs or {}, strict=False)


def _trace_export(model: nn.Module, example_inputs: tuple[Any, ...], library: list[type]) -> TracedProgram:
    with opaque_library_modules(model, example_inputs, library) as found:
        exported = export_module(model, tuple(example_inputs))
    module = exported.module()
    call_library_modules(module, found)
    if library_calls_left(module):
        raise TypeError("a library module is called inside a torch.no_grad() or torch.autocast region")
    graph = module.graph
    for node in list(graph.nodes):
        # The export's checks of what it saw: its guards, and the dtype asserts it puts before a
        # `.to(dtype)` (a float32 model's RMSNorm asserts float32 input), which bf16 autocast breaks.
        # Neither computes anything.
        if (node.op == "call_module" and node.target == "_guards_fn") or (
            node.op == "call_function" and node.target is torch.ops.aten._assert_tensor_metadata.default
        ):
            graph.erase_node(node)
    out_spec = graph._codegen.pytree_info.out_spec
    graph._codegen = CodeGen()
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    flat, _ = pytree.tree_flatten(output.args[0])
    output.args = (tuple(flat),)
    module.recompile()
    return TracedProgram(module=module, out_spec=out_spec, tracer="export")


def _flatten_output(module: fx.GraphModule, tracer: TracerName) -> TracedProgram:
    graph = module.graph
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    flat, spec = pytree.tree_flatten(output.args[0])
    output.args = (tuple(flat),)
    module.recompile()
    return TracedProgram(module=module, out_spec=spec, tracer=tracer)


def _agrees_with_eager(program: TracedProgram, model: nn.Module, example_inputs: tuple[Any, ...]) -> bool:
    """Guard against fx silently baking Python control flow in: compare one forward with eager, its outputs
    and the buffers it leaves (fx records no in-place change of a buffer made through Python, `self.n += 1`:
    the trace made it on the real tensor once)."""
    from .state import preserved_state

    with torch.no_grad(), preserved_state(model):
        torch.manual_seed(0)
        expected = pytree.tree_leaves(model(*example_inputs))
        expected += [b.detach().clone() for _, b in model.named_buffers()]
    with torch.no_grad(), preserved_state(model):  # the program holds the model's own buffers
        torch.manual_seed(0)
        got = list(program.module(*example_inputs))
        got += [b.detach().clone() for _, b in model.named_buffers()]
    if len(expected) != len(got):
        return False
    for e, g in zip(expected, got, strict=True):
        if isinstance(e, torch.Tensor) != isinstance(g, torch.Tensor):
            return False
        if isinstance(e, torch.Tensor):
            if e.shape != g.shape or e.dtype != g.dtype:
                return False
            if e.is_floating_point() and not torch.allclose(e, g, rtol=1e-4, atol=1e-5, equal_nan=True):
                return False
            if not e.is_floating_point() and not torch.equal(e, g):
                return False
    return True


def _check_autocast_gradients(
    program: TracedProgram, model: nn.Module, example_inputs: tuple[Any, ...], model_path: Path
) -> None:
    """torch.export (2.13) drops a torch.no_grad() region nested in a torch.autocast one: gradients
    would flow where the model has none. With an autocast region in the program, compare which
    parameters get gradients, and how large, between the model and the program (one forward and
    backward each); TraceFailure if they differ."""
    from .state import preserved_state

    params = [p for p in model.parameters() if p.requires_grad]

    def gradients(run: Any) -> list[torch.Tensor | None]:
        torch.manual_seed(0)
        outputs = [t for t in pytree.tree_leaves(run(*example_inputs)) if isinstance(t, torch.Tensor)]
        loss = sum((t.float().sum() for t in outputs if t.requires_grad), torch.zeros(()))
        if not loss.requires_grad:
            return [None] * len(params)
        return list(torch.autograd.grad(loss, params, allow_unused=True))

    with preserved_state(model), torch.random.fork_rng(devices=[]):
        expected = gradients(model)
        got = gradients(program.module)
    names = {id(p): name for name, p in model.named_parameters()}
    for param, e, g in zip(params, expected, got, strict=True):
        if (e is None) != (g is None) or (
            e is not None and g is not None and not torch.allclose(e, g, rtol=1e-3, atol=1e-5)
        ):
            raise TraceFailure(
                f"{display_path(model_path)}: torch.export changed the gradient of {names[id(param)]}: it drops a "
                "torch.no_grad() region inside a torch.autocast() region, so gradients would flow through it. "
                "Fix: put the torch.no_grad() region outside the torch.autocast() one, or .detach() its result"
            )


_FIXES = (
    "replace the branch on a tensor's value with torch.where(...) or torch.cond(...), "
    "or name the module that holds it with --leaf-module"
)


def _trace_failure(model_path: Path, fx_exc: BaseException | None, export_exc: BaseException | None) -> TraceFailure:
    """One message: where the model's code broke tracing, why, and the usual fix."""
    frame = None
    for exc in (export_exc, fx_exc):
        if exc is not None and frame is None:  # the innermost line of the model's folder: its own modules too
            frame = user_frame(exc, model_path.parent)
    where = frame_location(frame) if frame else display_path(model_path)
    line = f" at `{frame_source(frame)}`" if frame and frame_source(frame) else ""
    reasons = []
    if fx_exc is not None:
        reasons.append(f"torch.fx: {describe(fx_exc)}")
    if export_exc is not None:
        reasons.append(f"torch.export: {_short(describe(export_exc))}")
    fixes = _FIXES
    if export_exc is not None and "in output, which is not a known type" in str(export_exc):
        fixes = (
            "return tensors, or tuples, lists, dicts and dataclasses of them, from forward; a transformers "
            "model returns its cache object unless its config says use_cache=False"
        )
    if export_exc is not None and "data-dependent" in str(export_exc):
        # a loop or shape that follows tensor values has no graph at all: a leaf module would fail the same way
        fixes = (
            "replace the branch on a tensor's value with torch.where(...) or torch.cond(...); code whose loop count "
            "or shapes follow tensor values (a mixture of experts' loop over the experts hit) has no graph: "
            "vectorise it, or make its module part of an installed package, whose modules run as their own code"
        )
    if isinstance(fx_exc, RegionNotTraceable) and export_exc is None:
        fixes = "trace with --tracer auto or --tracer export, which keep the region"
    elif export_exc is None:  # --tracer fx: torch.export was not tried
        fixes += "; or trace with --tracer auto (the default), which falls back to torch.export"
    elif fx_exc is None:  # --tracer export: torch.fx was not tried
        fixes += "; or trace with --tracer auto (the default), which tries torch.fx first"
    return TraceFailure(f"{where}: cannot trace the model{line} ({'; '.join(reasons)}). Fix: {fixes}")


def module_path(node: fx.Node) -> str:
    """The innermost module a node was traced in ("" for the root)."""
    if node.op == "call_module":
        return str(node.target)
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return _clean_module_path(str(path))


def _clean_module_path(path: str) -> str:
    # torch.export writes paths like "L['self'].encoder.layer[0]" in some versions; normalise.
    path = path.removeprefix("L['self'].").removeprefix("L['self']")
    path = path.replace("[", ".").replace("]", "").replace("'", "")
    return path.split("@")[0]


def _higher_order_failure(model_path: Path, node: fx.Node, op: str) -> TraceFailure:
    """torch.export put part of the model in a higher-order op that stage code cannot hold: where, in
    which module, and what stage code can hold."""
    where = display_path(model_path)
    line = ""
    frame = _stack_frame(str(node.meta.get("stack_trace") or ""), model_path)
    if frame is not None:
        where, line = frame[0], f" `{frame[1]}`" if frame[1] else ""
    stack = node.meta.get("nn_module_stack") or {}
    path = module_path(node)
    kind = list(stack.values())[-1][1] if stack else ""
    kind = str(getattr(kind, "__qualname__", kind)).rsplit(".", 1)[-1]
    module = (f"module {path}" if path else "the model's own forward") + (f" ({kind})" if kind else "")
    why = (
        "which Cloudless cannot measure yet (torch runs it by tracing its branches, which the FLOP counter and "
        "activation accounting do not support)"
        if op in CALL_OPS
        else "which Cloudless cannot generate stage code for"
    )
    return TraceFailure(
        f"{where}: torch.export turned the model's code{line} in {module} into torch.ops.higher_order.{op}, "
        f"{why}; it supports the regions of torch.no_grad(), torch.enable_grad(), torch.set_grad_enabled() and "
        "torch.autocast(). Fix: write that code with plain torch operations (torch.where for a branch)"
    )


def _stack_frame(stack_trace: str, model_path: Path) -> tuple[str, str] | None:
    """(file:line, source) of the innermost frame of a node's recorded stack in the model file, else
    in any file outside the libraries."""
    frames = []
    lines = stack_trace.splitlines()
    for i, text in enumerate(lines):
        text = text.strip()
        if text.startswith('File "') and ", line " in text:
            filename = text[len('File "') : text.index('", line ')]
            number = text.split(", line ", 1)[1].split(",", 1)[0]
            source = lines[i + 1].strip() if i + 1 < len(lines) and not lines[i + 1].strip().startswith("File ") else ""
            frames.append((filename, number, source))
    wanted = str(model_path.resolve())
    own = [f for f in frames if _same_file(f[0], wanted)]
    others = [f for f in frames if not f[0].startswith("<") and not any(m in f[0] for m in _LIBRARY_MARKERS)]
    for filename, number, source in (own or others)[-1:]:
        return f"{display_path(Path(filename))}:{number}", source
    return None


def _same_file(filename: str, resolved: str) -> bool:
    try:
        return str(Path(filename).resolve()) == resolved
    except OSError:
        return False


def _short(text: str, limit: int = 240) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"
