"""Library ops: operators a stage calls that torch does not define, and what a function needs for them.

A traced model may call an operator a library registered with `torch.library.custom_op` (transformers'
mixture-of-experts calls `torch.ops.transformers.grouped_mm_fallback`). The op resolves only once the
module that registers it is imported, so a stage that calls one imports that module (its preamble,
with a `# registers torch.ops.<ns>.<op>` comment), and the function package installs the library,
pinned to the compiling machine's version, with its dependencies.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from dataclasses import dataclass
from pathlib import Path

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


#: what a function calls of the model file: the rest of it (build_model, load_shard, ...) runs where it compiles
FUNCTION_ENTRY_POINTS = ("transform", "collate_fn")


class UserImportError(ValueError):
    """The user's code a function runs imports a module this machine does not have, so it cannot be pinned."""


_Imports = list[tuple[ast.Import | ast.ImportFrom, bool]]


def _scoped_imports(tree: ast.Module) -> tuple[_Imports, dict[str, _Imports], dict[str, set[str]]]:
    """A module's imports run as it is imported (with: inside a `try`), those of each top-level function,
    and the bare names each top-level function calls."""
    at_import: _Imports = []
    by_function: dict[str, _Imports] = {}
    calls: dict[str, set[str]] = {}

    def visit(node: ast.AST, found: _Imports, guarded: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append((child, guarded))
            visit(child, found, guarded or isinstance(child, ast.Try))

    for statement in tree.body:
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found: _Imports = []
            by_function[statement.name] = found
            visit(statement, found, False)
            calls[statement.name] = {
                n.func.id for n in ast.walk(statement) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
            }
        elif isinstance(statement, (ast.Import, ast.ImportFrom)):
            at_import.append((statement, False))
        else:  # a class's methods count as run: a class is there to be used
            visit(statement, at_import, isinstance(statement, ast.Try))
    return at_import, by_function, calls


def third_party_imports(sources: dict[str, bytes], entry: str) -> list[str]:
    """The top-level modules outside the standard library and the sources themselves that a function
    imports when it imports `entry` (the model file, among `sources`: path -> bytes, its neighbours) and
    calls its FUNCTION_ENTRY_POINTS: what the model file and the neighbours import as they load, and the
    imports inside the entry points and the model file's functions they call (by name); a neighbour's
    functions all count. A module imported under a `try` that this machine lacks is optional, left out.
    UserImportError names
    the file and line of an import this machine cannot resolve to an installed distribution."""
    local = {Path(name).parts[0].removesuffix(".py") for name in sources}
    distributions = importlib.metadata.packages_distributions()
    found: set[str] = set()
    for name, data in sources.items():
        try:
            tree = ast.parse(data)
        except SyntaxError:
            continue  # the import of the model file reports it
        at_import, by_function, calls = _scoped_imports(tree)
        if name == entry:
            reached: set[str] = set()
            pending = [f for f in FUNCTION_ENTRY_POINTS if f in by_function]
            while pending:
                function = pending.pop()
                if function not in reached:
                    reached.add(function)
                    pending += [called for called in calls[function] if called in by_function]
        else:
            reached = set(by_function)
        imports = at_import + [each for function in sorted(reached) for each in by_function[function]]
        for statement, guarded in imports:
            if isinstance(statement, ast.ImportFrom):
                modules = [] if statement.level or not statement.module else [statement.module]
            else:
                modules = [alias.name for alias in statement.names]
            for module in modules:
                top = module.split(".")[0]
                if top in local or top in sys.stdlib_module_names or top == "__future__":
                    continue
                owners = distributions.get(top) or []
                if not owners:
                    if guarded:
                        continue
                    raise UserImportError(
                        f"{name}:{statement.lineno}: imports {module}, which no package installed here provides; "
                        "the function runs this code, so its package must install it: pip install it here, where "
                        "the build pins it"
                    )
                found.add(top)
    return sorted(found)
