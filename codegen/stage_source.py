"""Render one pipeline stage (a torch-only fx graph) as a readable, self-contained Python module.

The module defines `Stage(torch.nn.Module)` with every parameter and buffer the stage reads,
registered under its name in the original model (so the stage loads a slice of the model's
state dict, for example from safetensors), and the stage's forward as straight-line torch code.

torch.export puts regions and control flow in higher-order ops that take sub-graph modules. Each
sub-graph becomes a class of the file, rendered the same way (recursively: a sub-graph may hold
higher-order ops too), and an attribute of the stage (or of the sub-graph using it) holds an
instance; a sub-graph holds no tensors, its operands say what it reads. A grad-mode or autocast
region (`wrap_with_set_grad_enabled`, `wrap_with_autocast`) becomes a call of its sub-graph's
module, whose forward runs under `with torch.set_grad_enabled(...)` or `with torch.autocast(...)`,
which is all the op does when run eagerly. Control flow (`cond`, `map_impl`, `while_loop`, `scan`)
stays a call of the op itself on the sub-graphs' modules: torch runs those eagerly, autograd
included. Any other higher-order op is refused (`unsupported_higher_order_ops` lets the compiler
refuse it at trace time, naming the model's line).

The model is traced in training mode, which fixes the mode of ops whose behaviour depends on it as a
literal `True` (batch norm and instance norm with running statistics, the dropout family, rrelu) and
records batch norm's `num_batches_tracked.add_(1)`. The stage code reads the module's mode there instead
(`self.training`; a count of `int(self.training)`), so that `Stage().eval()` computes what `model.eval()`
does (`follow_modes`).
"""

from __future__ import annotations

import builtins
import importlib
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import fx
from torch._ops import HigherOrderOperator
from torch.utils import _pytree as pytree

from ..ir.protocol import user_attribute
from .libraries import import_lines
from .library_objects import REBUILD_SOURCE, LibraryObjects

#: Modules a stage's code may take functions from besides torch itself.
STANDARD_MODULES = {"operator", "_operator", "math", "builtins"}

_CONSTANTS = {
    "inf": 'inf = float("inf")',
    "nan": 'nan = float("nan")',
    "NoneType": "NoneType = type(None)",
    "device": "from torch import device",
}

#: Region ops, by name: the position of the sub-graph argument (the arguments before it are the
#: region's settings, those after it the sub-graph's operands).
REGION_OPS = {"wrap_with_set_grad_enabled": 1, "wrap_with_autocast": 4}
#: Control-flow ops, called as they are, on the sub-graphs' modules.
CALL_OPS = frozenset({"cond", "map_impl", "while_loop", "scan"})
SUPPORTED_HIGHER_ORDER_OPS = frozenset(REGION_OPS) | CALL_OPS


class _ModeFlag:
    """An argument rendered as code that reads the module's mode (fx renders an argument by its repr)."""

    def __init__(self, code: str) -> None:
        self.code = code

    def __repr__(self) -> str:
        return self.code


_TRAINING = _ModeFlag("self.training")
_COUNT_IF_TRAINING = _ModeFlag("int(self.training)")
_F = torch.nn.functional
_aten = torch.ops.aten
#: ops whose training flag the trace fixed: target -> (the flag's position, its keyword, the position of an
#: argument that must not be None for the flag to follow the mode: the running statistics, without which
#: batch norm normalises by the batch's in eval mode too)
_MODE_FLAGS: dict[Any, tuple[int, str, int | None]] = {
    _aten.batch_norm.default: (5, "training", 3),
    _F.batch_norm: (5, "training", 1),
    _aten.instance_norm.default: (5, "use_input_stats", 3),
    _F.instance_norm: (5, "use_input_stats", 1),
    **{op: (2, "training", None) for op in (_F.dropout, _F.dropout1d, _F.dropout2d, _F.dropout3d)},
    **{op: (2, "training", None) for op in (_F.alpha_dropout, _F.feature_alpha_dropout)},
    **{
        op: (2, "train", None)
        for op in (
            _aten.dropout.default,
            _aten.native_dropout.default,
            _aten.feature_dropout.default,
            _aten.alpha_dropout.default,
            _aten.feature_alpha_dropout.default,
        )
    },
    _F.rrelu: (3, "training", None),
    _aten.rrelu.default: (3, "training", None),
}


def follow_modes(graph: fx.Graph) -> fx.Graph:
    """A copy of `graph` whose training-mode literals read the module's mode instead (the module docstring)."""
    copy = fx.Graph()
    copy.output(copy.graph_copy(graph, {}))
    for node in copy.nodes:
        flag = _MODE_FLAGS.get(node.target) if node.op == "call_function" else None
        if flag is not None:
            position, keyword, needed = flag
            if needed is not None and (len(node.args) <= needed or node.args[needed] is None):
                continue
            if len(node.args) > position and node.args[position] is True:
                node.args = (*node.args[:position], _TRAINING, *node.args[position + 1 :])
            elif node.kwargs.get(keyword) is True:
                node.kwargs = {**node.kwargs, keyword: _TRAINING}
        counted = node.target is _aten.add_.Tensor or (node.op == "call_method" and node.target == "add_")
        if counted and len(node.args) == 2 and node.args[1] == 1 and _counter(node.args[0]):
            node.args = (node.args[0], _COUNT_IF_TRAINING)  # batch norm counts its batches in training only
    return copy


def _counter(value: Any) -> bool:
    return isinstance(value, fx.Node) and value.op == "get_attr" and str(value.target).endswith("num_batches_tracked")


#: Names of the generated file a sub-graph's class must not take.
_RESERVED_CLASSES = {"Stage", "NoneType", "INPUTS", "OUTPUTS", "TENSORS"}


#: a stage's tensor: a parameter it trains, a parameter the model froze (requires_grad=False: never
#: trained, synced or checkpointed), or a buffer
TensorKind = Literal["parameter", "frozen", "buffer"]


@dataclass(frozen=True)
class StageHeader:
    """What the generated file says about itself."""

    model: str
    index: int
    count: int
    first_block: int
    last_block: int
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    #: name -> (shape, dtype, kind)
    tensors: dict[str, tuple[tuple[int, ...], str, TensorKind]]
    #: the docstring's first line, when the module is not a pipeline stage (the loss, for example)
    title: str = ""
    #: small constant tensors written into the source (a module without a weights file: the loss)
    constants: dict[str, torch.Tensor] = field(default_factory=dict)
    #: the model file (its path): a function of it, or of a module beside it, the code calls is found where
    #: the stage runs (protocol.user_attribute; the package ships them in its user/ folder)
    model_file: str | None = None
    #: the stage's buffers its forward changes -> (rule, momentum): how its replicas combine them
    #: (compiler/frontend/buffer_rules.py; the worker's BufferUpdates follows them)
    buffer_rules: dict[str, tuple[str, float | None]] = field(default_factory=dict)


def _buffer_rules_lines(rules: dict[str, tuple[str, float | None]]) -> list[str]:
    if not rules:
        return []
    return [
        "# buffers the forward changes: (rule, momentum): 'average' (running statistics), 'count' (a batch",
        "# counter), 'sequence' (the stage runs one replica); how the stage's replicas combine them",
        "BUFFER_RULES = {",
        *(f"    {name!r}: {rule!r}," for name, rule in rules.items()),
        "}",
    ]


_FX_WRAP = re.compile(r'^\s*torch\.fx\._symbolic_trace\.wrap\("[^"]*"\)\s*$')


def calls_user_code(source: str) -> bool:
    """Whether generated code calls the user's own functions (the package then ships the model file)."""
    return f"{user_attribute.__name__}(" in source


def higher_order_op(node: fx.Node) -> str | None:
    """The name of the higher-order op `node` calls (`torch.ops.higher_order.<name>`), else None."""
    if node.op == "call_function" and isinstance(node.target, HigherOrderOperator):
        return str(node.target.name())
    return None


def unsupported_higher_order_ops(
    module: torch.nn.Module, supported: frozenset[str] = SUPPORTED_HIGHER_ORDER_OPS
) -> list[tuple[fx.Node, str]]:
    """Each higher-order op not in `supported` (by default: those stage code can hold) in `module`'s
    graph, or in a sub-graph of one that is: (the node of `module`'s graph that holds it, the op)."""
    found: list[tuple[fx.Node, str]] = []
    graph = getattr(module, "graph", None)
    if not isinstance(graph, fx.Graph):
        return found
    for node in graph.nodes:
        name = higher_order_op(node)
        if name is None:
            continue
        if name not in supported:
            found.append((node, name))
            continue
        for arg in pytree.tree_leaves((node.args, node.kwargs)):
            if isinstance(arg, fx.Node) and arg.op == "get_attr":
                sub = _fetch(module, str(arg.target))
                found.extend((node, inner) for _, inner in unsupported_higher_order_ops(sub, supported))
    return found


def render_stage_source(graph: fx.Graph, header: StageHeader) -> str:
    """The stage's module. A graph with sub-graph modules must be owned by its GraphModule (they are
    read from there); ValueError if the graph reads what the file would not hold."""
    renderer = _Renderer(header.model_file)
    # a call_module node left in the stage is a library module, run as the library's own code
    library = LibraryObjects()
    owner = graph.owning_module
    rebuilt = {
        str(n.target): library.module(owner.get_submodule(str(n.target)), str(n.target))
        for n in graph.nodes
        if n.op == "call_module" and owner is not None
    }
    body, children = renderer.forward(graph, owner, tensors={*header.tensors, *header.constants}, modules=set(rebuilt))
    preamble = _preamble(renderer.text(body), renderer.globals, header.model_file)
    forward = _indent(body)
    tensors = "\n".join(
        f"    {name!r}: ({tuple(shape)!r}, {dtype!r}, {kind!r}),"
        for name, (shape, dtype, kind) in header.tensors.items()
    )
    # a library's ops resolve once the module registering them is imported
    libraries = sorted({*import_lines(renderer.text(body)), *library.import_lines()} - {"import torch"})
    imports = "torch" + "".join(f" and {line.split()[1]}" for line in libraries if "  # " in line)
    title = header.title or (
        f"Stage {header.index} of {header.count} of {header.model}: blocks {header.first_block}-{header.last_block}."
    )
    lines = [
        f'"""{title}',
        "",
        f"Generated by Cloudless; imports {'only torch' if imports == 'torch' else imports}. Load its weights with "
        "load_state_dict.",
        '"""',
        "",
        "import torch",
        *libraries,
        *preamble,
        "",
        f"INPUTS = {header.inputs!r}",
        f"OUTPUTS = {header.outputs!r}",
        "# name: (shape, dtype, kind): a trained parameter, a frozen one (requires_grad=False) or a buffer",
        "TENSORS = {",
        *([tensors] if tensors else []),
        "}",
        *_buffer_rules_lines(header.buffer_rules),
        "",
        "",
        *[line for source in renderer.classes for line in (*source, "", "")],
        "class Stage(torch.nn.Module):",
        "    def __init__(self) -> None:",
        "        super().__init__()",
        *[f"        _attach(self, {name!r}, {expression})" for name, expression in rebuilt.items()],
        "        for name, (shape, dtype, kind) in TENSORS.items():",
        "            _install(self, name, torch.empty(shape, dtype=getattr(torch, dtype)), kind)",
        *[
            # not state: load_state_dict of the (empty) weights leaves them as written
            f"        self.register_buffer({name!r}, torch.tensor({value.tolist()!r}, dtype=torch.{_dtype(value)})"
            f".reshape({tuple(value.shape)!r}), persistent=False)"
            for name, value in header.constants.items()
        ],
        *[f"        self.{attr} = {cls}()" for attr, cls in children],
        "",
        forward.rstrip(),
        "",
        "",
        "def _install(root: torch.nn.Module, name: str, tensor: torch.Tensor, kind: str) -> None:",
        '    *path, leaf = name.split(".")',
        "    owner = root",
        "    for part in path:",
        "        if part not in owner._modules:",
        "            owner.add_module(part, torch.nn.Module())",
        "        owner = owner._modules[part]",
        "    if kind != 'buffer':",
        "        owner.register_parameter(leaf, torch.nn.Parameter(tensor, requires_grad=kind == 'parameter'))",
        "    else:",
        "        owner.register_buffer(leaf, tensor)",
        "",
        *(["", REBUILD_SOURCE.rstrip("\n"), ""] if rebuilt else []),
    ]
    return "\n".join(lines)


class _Renderer:
    """Renders a graph's forward and, as classes, the sub-graph modules it calls."""

    def __init__(self, model_file: str | None = None) -> None:
        #: each sub-graph class's lines (a class before those that use it)
        self.classes: list[list[str]] = []
        self.globals: dict[str, Any] = {}
        self.model_file = model_file
        self._bodies: list[str] = []
        self._class_names: set[str] = set(_RESERVED_CLASSES)

    def text(self, body: str) -> str:
        """All the code rendered, for the preamble's imports."""
        return "\n".join([body, *self._bodies])

    def forward(
        self, graph: fx.Graph, owner: torch.nn.Module | None, tensors: set[str] | None, modules: set[str] | None = None
    ) -> tuple[str, list[tuple[str, str]]]:
        """`def forward(...)` of `graph` and its submodules, (attribute, class name) each.

        `tensors`: the tensor attributes the graph may read (None: none, a sub-graph); `modules`: the
        library modules it may call."""
        children: list[tuple[str, str]] = []
        if _has_subgraphs(graph, owner):
            if owner is None:
                raise ValueError("internal: a graph with sub-graph modules must be owned by its module")
            graph, children = self._rewrite(graph, owner, (tensors or set()) | (modules or set()))
        _check_attributes(graph, tensors or set(), {attr for attr, _ in children} | (modules or set()))
        code = follow_modes(graph).python_code(root_module="self")
        # fx marks the wrapped functions it calls for a re-trace (`torch.fx._symbolic_trace.wrap("name")`, legal
        # only at a module's top level); stage code is run, never traced again
        source = "\n".join(line for line in code.src.splitlines() if not _FX_WRAP.match(line))
        for name, value in code.globals.items():
            stable = self._stable_name(name, value)
            if stable != name:
                source = re.sub(rf"\b{re.escape(name)}\b", stable, source)
            if stable in self.globals and self.globals[stable] is not value:
                raise ValueError(f"internal: two sub-graphs' code name different values {stable}")
            self.globals[stable] = value
        return source.strip("\n"), children

    def _stable_name(self, name: str, value: Any) -> str:
        """fx names a function of the user's after its module, which the compiler imports the model file
        under a name of its path's hash: `user_<function>` instead (a build is the same on every machine)."""
        module = getattr(value, "__module__", None) or ""
        if _user_module(module, self.model_file) is None:
            return name
        stable = taken = "user_" + _identifier(getattr(value, "__qualname__", name))
        suffix = 1
        while stable in self.globals and self.globals[stable] is not value:
            stable, suffix = f"{taken}_{suffix}", suffix + 1
        return stable

    def _rewrite(
        self, graph: fx.Graph, owner: torch.nn.Module, tensors: set[str]
    ) -> tuple[fx.Graph, list[tuple[str, str]]]:
        """A copy of `graph` whose region ops call their sub-graph's module and whose sub-graph
        attributes are named as the generated class holds them."""
        copy = fx.Graph()
        copy.output(copy.graph_copy(graph, {}))
        taken = {name.split(".")[0] for name in tensors}
        made: dict[tuple[Any, ...], str] = {}
        children: list[tuple[str, str]] = []

        def child(target: str, sub: fx.GraphModule, doc: str, region: str | None) -> str:
            key = (target, region)
            if key not in made:
                attr = _unique(_identifier(target), taken)
                taken.add(attr)
                made[key] = attr
                children.append((attr, self._render_class(attr, sub, doc, region)))
            return made[key]

        for node in list(copy.nodes):
            name = higher_order_op(node)
            if name is None:
                continue
            if name not in SUPPORTED_HIGHER_ORDER_OPS:
                raise ValueError(
                    f"stage code cannot hold torch.ops.higher_order.{name} (node {node.name}); it holds "
                    f"{', '.join(sorted(SUPPORTED_HIGHER_ORDER_OPS))}"
                )
            if name not in REGION_OPS:
                continue
            position = REGION_OPS[name]
            if len(node.args) <= position:
                raise ValueError(f"internal: unexpected arguments of torch.ops.higher_order.{name} ({node.name})")
            settings, body, operands = node.args[:position], node.args[position], node.args[position + 1 :]
            if not isinstance(body, fx.Node) or body.op != "get_attr" or any(isinstance(a, fx.Node) for a in settings):
                raise ValueError(f"internal: unexpected arguments of torch.ops.higher_order.{name} ({node.name})")
            sub = _subgraph(owner, str(body.target))
            region = _region(name, settings)
            attr = child(str(body.target), sub, f"Sub-graph `{body.target}`: runs under `{region}`.", region)
            node.op, node.target, node.args = "call_module", attr, tuple(operands)
            if not body.users:
                copy.erase_node(body)
        for node in copy.nodes:
            if node.op == "get_attr" and isinstance(_fetch(owner, str(node.target)), fx.GraphModule):
                sub = _subgraph(owner, str(node.target))
                ops = sorted({op for user in node.users if (op := higher_order_op(user))})
                doc = f"Sub-graph `{node.target}` of {', '.join(f'torch.ops.higher_order.{op}' for op in ops)}."
                node.target = child(str(node.target), sub, doc, None)
        copy.lint()
        return copy, children

    def _render_class(self, attr: str, sub: fx.GraphModule, doc: str, region: str | None) -> str:
        name = _unique("".join(part.capitalize() for part in attr.split("_") if part) or "Subgraph", self._class_names)
        self._class_names.add(name)
        body, children = self.forward(sub.graph, sub, None)
        self._bodies.append(body)
        definition, *statements = body.splitlines()
        if not definition.startswith("def forward("):
            raise ValueError(f"internal: unexpected code for sub-graph {attr}: {definition}")
        if region is not None:
            statements = [f"    with {region}:", *("    " + line if line.strip() else "" for line in statements)]
        lines = [f"class {name}(torch.nn.Module):", f'    """{doc}"""', ""]
        if children:
            lines += ["    def __init__(self) -> None:", "        super().__init__()"]
            lines += [f"        self.{a} = {c}()" for a, c in children]
            lines.append("")
        lines += _indent("\n".join([definition, *statements])).splitlines()
        self.classes.append([line.rstrip() for line in lines])
        return name


def _dtype(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _has_subgraphs(graph: fx.Graph, owner: torch.nn.Module | None) -> bool:
    for node in graph.nodes:
        if higher_order_op(node) is not None:
            return True
        if node.op == "get_attr" and owner is not None:
            try:
                if isinstance(_fetch(owner, str(node.target)), fx.GraphModule):
                    return True
            except AttributeError:
                continue
    return False


def _check_attributes(graph: fx.Graph, tensors: set[str], modules: set[str]) -> None:
    """Every attribute the code reads is one the generated module holds."""
    for node in graph.nodes:
        if node.op == "get_attr" and node.target not in tensors and node.target not in modules:
            raise ValueError(f"stage code reads self.{node.target}, which it does not hold")
        if node.op == "call_module" and node.target not in modules:
            raise ValueError(f"stage code calls module self.{node.target}, which it does not hold")


def _region(name: str, settings: tuple[Any, ...]) -> str:
    """The context manager that does what the region op does."""
    if name == "wrap_with_set_grad_enabled":
        (enabled,) = settings
        return f"torch.set_grad_enabled({bool(enabled)!r})"
    device_type, dtype, enabled, cache_enabled = settings
    dtype_text = "None" if dtype is None else f"torch.{str(dtype).removeprefix('torch.')}"
    return (
        f"torch.autocast(device_type={str(device_type)!r}, dtype={dtype_text}, enabled={bool(enabled)!r}, "
        f"cache_enabled={cache_enabled!r})"
    )


def _subgraph(owner: torch.nn.Module, target: str) -> fx.GraphModule:
    value = _fetch(owner, target)
    if not isinstance(value, fx.GraphModule):
        raise ValueError(f"internal: {target} is not a sub-graph module")
    return value


def _fetch(module: torch.nn.Module, target: str) -> Any:
    value: Any = module
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _identifier(text: str) -> str:
    name = re.sub(r"\W", "_", text)
    return name if name and not name[0].isdigit() else f"_{name}"


def _unique(name: str, taken: set[str]) -> str:
    if name not in taken:
        return name
    i = 1
    while f"{name}_{i}" in taken:
        i += 1
    return f"{name}_{i}"


def _indent(code: str) -> str:
    return "\n".join(("    " + line) if line.strip() else "" for line in code.splitlines())


def _user_module(module: str, model_file: str | None) -> str | None:
    """How stage code names `module` if it is the user's: "" for the model file itself, its name for a module
    beside it (its file in the model file's folder, or below); None for any other."""
    if model_file is None or module.split(".")[0] == "torch" or module in STANDARD_MODULES:
        return None
    found = getattr(sys.modules.get(module), "__file__", None)
    if found is None:
        return None
    path, model = Path(found).resolve(), Path(model_file).resolve()
    if path == model:
        return ""
    # beside the model file, and not an installed package (a virtual environment in the model's folder)
    installed = {"site-packages", "dist-packages"} & set(path.parts)
    return module if model.parent in path.parents and not installed else None


def _preamble(body: str, globals_: dict[str, Any], model_file: str | None = None) -> list[str]:
    used = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", body))
    lines: set[str] = set()
    for name, value in globals_.items():
        if name not in used or name == "torch" or hasattr(builtins, name):
            continue
        if name in _CONSTANTS:
            lines.add(_CONSTANTS[name])
            continue
        module = getattr(value, "__module__", None) or ""
        qualname = getattr(value, "__qualname__", "")
        user = _user_module(module, model_file)
        if user is not None and _resolve(module, qualname) is value:
            # the user's own function, shipped in the package's user/ folder and found where the stage runs
            assert model_file is not None
            lines.add(f"from cloudless.ir.protocol import {user_attribute.__name__}")
            where = f", module={user!r}" if user else ""
            lines.add(f"{name} = {user_attribute.__name__}({Path(model_file).name!r}, {qualname!r}{where})")
            continue
        top = module.split(".")[0]
        if top != "torch" and module not in STANDARD_MODULES:
            raise ValueError(
                f"stage code calls {qualname or value!r} from {module or 'an unknown module'}, which is not "
                "torch, the standard library or the model's own code; --tracer export traces through it"
            )
        importable = "operator" if module == "_operator" else module
        if _resolve(importable, qualname) is not value:
            raise ValueError(f"stage code calls {value!r}, which cannot be imported by name")
        lines.add(f"import {importable}")
        lines.add(f"{name} = {importable}.{qualname}")
    imports = sorted(line for line in lines if line.startswith(("import", "from")))
    assignments = sorted(line for line in lines if not line.startswith(("import", "from")))
    return imports + ([""] if imports and assignments else []) + assignments


def _resolve(module: str, qualname: str) -> Any:
    value: Any = importlib.import_module(module)
    for part in qualname.split("."):
        value = getattr(value, part, None)
    return value
