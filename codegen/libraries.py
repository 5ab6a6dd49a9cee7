"""Library ops: operators a stage calls that torch does not define, and what a function needs for them.

A traced model may call an operator a library registered with `torch.library.custom_op` (transformers'
mixture-of-experts calls `torch.ops.transformers.grouped_mm_fallback`). The op resolves only once the
module that registers it is imported, so a stage that calls one imports that module (its preamble,
with a `# registers torch.ops.<ns>.<op>` comment), and the function package installs the library,
pinned to the compiling machine's version, with its dependencies.
"""

from __future__ import annotations

import importlib.metadata
import re
import sys
from dataclasses import dataclass

from packaging.markers import Marker
from packaging.requirements import Requirement

#: the op namespaces torch itself defines (its aten operators, primitives and higher-order ops, ...)
TORCH_NAMESPACES = frozenset(
    {"aten", "prims", "prim", "higher_order", "quantized", "_quantized", "quantized_decomposed", "c10d",
     "_c10d_functional", "_c10d_functional_autograd", "_dtensor", "profiler", "inductor", "mkldnn", "onednn"}
)  # fmt: skip
_OP_CALL = re.compile(r"\btorch\.ops\.([A-Za-z_]\w*)\.([A-Za-z_]\w*)")
#: the preamble line a stage imports a registering module with
_IMPORT_LINE = re.compile(r"^import ([\w.]+)  # registers (torch\.ops\.[\w.]+(?:, torch\.ops\.[\w.]+)*)$", re.M)
#: any preamble line importing a library: for its ops (`# registers`) or its classes (`# defines`)
_LIBRARY_LINE = re.compile(r"^import ([\w.]+)  # (?:registers|defines) ", re.M)


class LibraryOpError(ValueError):
    """A stage calls a library op whose registering module cannot be told."""


def library_ops(source: str) -> list[str]:
    """The library ops (`namespace::name`) the code calls, in sorted order."""
    return sorted({f"{ns}::{name}" for ns, name in _OP_CALL.findall(source) if ns not in TORCH_NAMESPACES})


def registering_module(op: str) -> str:
    """The module whose import registers `op` (made with `torch.library.custom_op`)."""
    from torch._library.custom_ops import OPDEFS

    namespace, name = op.split("::")
    definition = OPDEFS.get(op)
    module = getattr(getattr(definition, "_init_fn", None), "__module__", None)
    if definition is None and namespace in sys.modules:  # a package registering its namespace's ops
        module = namespace  # (in C++, as torchvision does): importing it registers them
    if not module or module == "__main__" or module not in sys.modules:
        raise LibraryOpError(
            f"the model calls torch.ops.{namespace}.{name}, an operator torch does not define, and Cloudless "
            "cannot tell which importable module registers it (it was not made with torch.library.custom_op "
            "in a module of an installed package). Fix: define it with torch.library.custom_op in a module "
            "of an installed package, or make the model call torch operators there"
        )
    return module


def import_lines(source: str) -> list[str]:
    """The preamble lines that import the modules registering the code's library ops."""
    by_module: dict[str, list[str]] = {}
    for op in library_ops(source):
        namespace, name = op.split("::")
        by_module.setdefault(registering_module(op), []).append(f"torch.ops.{namespace}.{name}")
    for module, ops in by_module.items():
        try:
            distribution_of(module)
        except LibraryOpError:
            where = getattr(sys.modules[module], "__file__", None) or module
            raise LibraryOpError(
                f"the model calls {', '.join(ops)}, registered by {where}, which no installed package provides: a "
                "function installs packages, not the model's folder. Fix: make the module part of a package "
                "installed here (pip install it), or call torch operators instead"
            ) from None
    return [f"import {module}  # registers {', '.join(ops)}" for module, ops in sorted(by_module.items())]


def imported_registrations(source: str) -> dict[str, list[str]]:
    """Module -> the ops a stage's preamble says its import registers."""
    return {m.group(1): m.group(2).split(", ") for m in _IMPORT_LINE.finditer(source)}


def library_imports(source: str) -> list[str]:
    """The library modules a stage's preamble imports (for ops it calls or classes it rebuilds)."""
    return sorted({m.group(1) for m in _LIBRARY_LINE.finditer(source)})


def unimported_classes(source: str) -> list[str]:
    """The library classes a stage rebuilds (`_rebuild(module.Class, ...)`) from modules it does not import."""
    imported = set(library_imports(source))
    return sorted({f"{m}.{name}" for m, name in re.findall(r"_rebuild\(([\w.]+)\.(\w+),", source) if m not in imported})


def unregistered_ops(source: str) -> list[str]:
    """The library ops the code calls that none of its preamble's imports registers."""
    registered = {op for ops in imported_registrations(source).values() for op in ops}
    return [
        f"torch.ops.{op.replace('::', '.')}"
        for op in library_ops(source)
        if f"torch.ops.{op.replace('::', '.')}" not in registered
    ]


@dataclass(frozen=True)
class LibraryPin:
    """A distribution a function installs for its library ops: the compiling machine's version."""

    name: str
    version: str


def distribution_of(module: str) -> str:
    """The installed distribution that provides `module`'s top-level package."""
    top = module.split(".")[0]
    names = importlib.metadata.packages_distributions().get(top) or []
    if not names:
        raise LibraryOpError(f"module {module} registers an op the model calls, but no installed package provides it")
    return sorted(names)[0]


def library_pins(modules: list[str], environment: dict[str, str], skip: frozenset[str]) -> tuple[LibraryPin, ...]:
    """The distributions providing `modules` and everything they require in `environment` (PEP 508
    marker values of the function's image), each at the version installed here; names in `skip`
    (installed by the image otherwise) are left out."""
    seen: dict[str, LibraryPin] = {}
    pending = [distribution_of(module) for module in modules]
    while pending:
        name = pending.pop()
        key = canonical_name(name)
        if key in seen or key in skip:
            continue
        distribution = importlib.metadata.distribution(name)
        seen[key] = LibraryPin(distribution.metadata["Name"], distribution.version)
        for text in distribution.requires or []:
            requirement = Requirement(text)
            if requirement.marker is not None and not Marker(str(requirement.marker)).evaluate(
                {**environment, "extra": ""}
            ):
                continue
            pending.append(requirement.name)
    return tuple(sorted(seen.values(), key=lambda pin: canonical_name(pin.name)))


def canonical_name(name: str) -> str:
    """A distribution's name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()
