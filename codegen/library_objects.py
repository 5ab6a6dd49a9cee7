"""Library modules in stage code: a module of an installed library that the stage runs as its own code.

A module whose forward has no graph (its loop count or shapes follow tensor values, as transformers'
eager mixture of experts loops over the experts a batch hits) stays one `call_module` node of the
stage. The stage's source rebuilds it as pickle would, without pickle: an instance of its class (imported
by name from the library, which the function installs) made with `cls.__new__`, its attributes
restored from literals written into the source, its child modules rebuilt the same way; its parameters
and buffers are the stage's tensors, loaded from the weights file like every other.

What can be written as a literal: None, booleans, numbers, strings, tuples, lists, dicts and sets of
them, torch dtypes and devices, enum members, functions and classes importable by name, and objects of
an importable class whose state is its `__dict__` of such values (a transformers config). Anything else
(a tensor that is neither a parameter nor a buffer, a lambda, a hook) is a ValueError naming the
attribute.
"""

from __future__ import annotations

import enum
import importlib
import math
import sys
import types
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx.node import _get_qualified_name

from .libraries import LibraryOpError, distribution_of

#: the attributes every nn.Module has: its own machinery, not the library's state
_MODULE_FIELDS = frozenset(vars(torch.nn.Module()))
_HOOKS = tuple(name for name in _MODULE_FIELDS if "hook" in name)
#: the preamble comment a library import carries
DEFINES = "# defines"


@dataclass
class LibraryObjects:
    """Renders library objects as expressions; collects the modules the expressions import."""

    #: module -> the names of it the expressions use
    imports: dict[str, set[str]] = field(default_factory=dict)

    def module(self, module: torch.nn.Module, where: str) -> str:
        """`_rebuild(...)` of a library module, its children included (not its tensors)."""
        return self._object(module, where, set())

    def import_lines(self) -> list[str]:
        """A library's modules carry `# defines` (the function installs the library); torch's and the
        standard library's are plain imports."""
        return [
            f"import {module}"
            if _is_standard(module.split(".")[0]) or module.split(".")[0] == "torch"
            else f"import {module}  {DEFINES} {', '.join(sorted(names))}"
            for module, names in sorted(self.imports.items())
        ]

    def _value(self, value: Any, where: str, active: set[int]) -> str:
        if value is None or isinstance(value, (bool, int, str, bytes)):
            return repr(value)
        if isinstance(value, float):
            return repr(value) if math.isfinite(value) else f'float("{value}")'
        if isinstance(value, torch.dtype):
            return str(value)
        if isinstance(value, torch.device):
            return f"torch.device({str(value)!r})"
        if isinstance(value, torch.Tensor):
            raise ValueError(
                f"{where} is a tensor that is neither a parameter nor a buffer: the stage cannot hold it; "
                "register it with register_buffer"
            )
        if isinstance(value, enum.Enum):
            return f"{self._name(type(value), where)}.{value.name}"
        if id(value) in active:
            raise ValueError(f"{where} refers back to an object that holds it: the stage cannot rebuild it")
        if isinstance(value, (tuple, list, set, frozenset, dict)):
            active = active | {id(value)}
            if isinstance(value, dict):
                items = ", ".join(
                    f"{self._value(k, where, active)}: {self._value(v, f'{where}[{k!r}]', active)}"
                    for k, v in value.items()
                )
                return f"{{{items}}}"
            parts = [self._value(v, f"{where}[{i}]", active) for i, v in enumerate(value)]
            if isinstance(value, (set, frozenset)):
                return f"{type(value).__name__}([{', '.join(sorted(parts))}])"
            if isinstance(value, tuple):
                return f"({parts[0]},)" if len(parts) == 1 else f"({', '.join(parts)})"
            return f"[{', '.join(parts)}]"
        if isinstance(value, type) or _is_function(value):
            return self._name(value, where)
        return self._object(value, where, active | {id(value)})

    def _object(self, value: Any, where: str, active: set[int]) -> str:
        cls = type(value)
        name = self._name(cls, where)
        if getattr(cls, "__slots__", None) or not hasattr(value, "__dict__"):
            raise ValueError(f"{where} is a {cls.__qualname__} without a __dict__: the stage cannot rebuild it")
        restorer = next((c for c in cls.__mro__ if "__setstate__" in vars(c)), object)
        if restorer not in (object, torch.nn.Module):  # nn.Module's only fills in attributes __init__ sets
            raise ValueError(f"{where} is a {cls.__qualname__}, which restores its state its own way (__setstate__)")
        state = dict(vars(value))
        children: dict[str, str] = {}
        if isinstance(value, torch.nn.Module):
            for hook in _HOOKS:
                if getattr(value, hook, None):
                    raise ValueError(f"{where} has {hook.strip('_').replace('_', ' ')}: the stage would not run them")
            for child_name, child in value._modules.items():
                children[child_name] = (
                    "None" if child is None else self._object(child, f"{where}.{child_name}", active | {id(child)})
                )
            state = {k: v for k, v in state.items() if k not in _MODULE_FIELDS}
        attributes = ", ".join(f"{k!r}: {self._value(v, f'{where}.{k}', active)}" for k, v in state.items())
        modules = ", ".join(f"{k!r}: {v}" for k, v in children.items())
        return f"_rebuild({name}, {{{attributes}}}{f', {{{modules}}}' if modules else ''})"

    def _name(self, value: Any, where: str) -> str:
        """`module.qualname` of a class or function importable by that name from torch, the standard
        library or an installed package."""
        module = getattr(value, "__module__", None) or ""
        qualname = getattr(value, "__qualname__", "") or ""
        if _resolve(module, qualname) is not value and _is_function(value):
            # torch's C functions (torch.tanh) name their module as fx does when it writes them
            module, _, qualname = _get_qualified_name(value).rpartition(".")
        if not module or "<" in qualname or _resolve(module, qualname) is not value:
            raise ValueError(f"{where}: {value!r} cannot be imported by name, so the stage cannot rebuild it")
        top = module.split(".")[0]
        if top not in ("torch", "builtins") and not _is_standard(top):
            try:
                distribution_of(module)
            except LibraryOpError:
                raise ValueError(
                    f"{where} is a {qualname} from {module}, which no installed package provides: a function "
                    "installs packages, not the model's folder. Fix: make it part of an installed package"
                ) from None
        if top == "builtins":
            return qualname
        self.imports.setdefault(module, set()).add(qualname.split(".")[0])
        return f"{module}.{qualname}"


#: the helper a stage with library modules defines (after its class; called from its __init__)
REBUILD_SOURCE = '''\
def _rebuild(cls: type, state: dict, modules: dict | None = None):
    """An instance of a library class with `state` as its attributes: what pickle restores, from literals."""
    value = cls.__new__(cls)
    if isinstance(value, torch.nn.Module):
        torch.nn.Module.__init__(value)
    value.__dict__.update(state)
    for name, module in (modules or {}).items():
        value._modules[name] = module
    return value


def _attach(root: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    *path, leaf = name.split(".")
    owner = root
    for part in path:
        if part not in owner._modules:
            owner.add_module(part, torch.nn.Module())
        owner = owner._modules[part]
    owner.add_module(leaf, module)
'''


def _is_function(value: Any) -> bool:
    return isinstance(value, (types.FunctionType, types.BuiltinFunctionType))


def _is_standard(top: str) -> bool:
    return top in sys.stdlib_module_names


def _resolve(module: str, qualname: str) -> Any:
    try:
        value: Any = importlib.import_module(module)
    except ImportError:
        return None
    for part in qualname.split("."):
        value = getattr(value, part, None)
    return value
