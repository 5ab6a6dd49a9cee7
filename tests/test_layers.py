"""The layers import one way (docs/design.md, "Layers and data flow"), no module imports itself by a detour,
and what a function package vendors imports nothing it does not ship.

The import graph is built from the sources (every `import`, lazy and TYPE_CHECKING ones too: a cycle hidden
in a function body is still a cycle of the design) and checked with networkx: no cycle anywhere, and within
`compiler/` and `runtimes/` every import goes down the layer order below, never up."""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable
from pathlib import Path

import networkx as nx
import pytest

from cloudless.codegen.package import VENDORED_FOLDERS, VENDORED_IR, runtime_sources
from cloudless.ir.protocol import PARQUET_READER

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("ir", "compiler", "codegen", "runtimes")
#: what each top-level package may import of Cloudless (a package, or one room of one): the compiler reads
#: the index of data where it lies with the storage room's code, the same the controller reads it with
ALLOWED = {
    "ir": {"ir"},
    "compiler": {"ir", "compiler", "codegen", "runtimes.storage"},
    "codegen": {"ir", "codegen"},
    "runtimes": {"ir", "runtimes"},
}
#: within a package, its rooms from the top down: a module imports its own room's modules or those of a room
#: below. A room is a module prefix; a module is in the room of its longest matching prefix.
ROOMS = {
    "compiler": (
        # the CLI and the sequence of passes, lowering and writing the build
        ("cloudless.compiler.cli", "cloudless.compiler.pipeline"),
        ("cloudless.compiler.build", "cloudless.compiler.lower"),
        ("cloudless.compiler.planner",),
        ("cloudless.compiler.frontend",),
        ("cloudless.compiler.errors",),
    ),
    "runtimes": (
        ("cloudless.runtimes.cli",),
        ("cloudless.runtimes.rehearsal",),
        ("cloudless.runtimes.clouds",),
        ("cloudless.runtimes.control",),
        ("cloudless.runtimes.function",),
        ("cloudless.runtimes.storage",),
        ("cloudless.runtimes",),
    ),
}
#: what a function's image installs (requirements.txt): torch, safetensors, the storage clients, and what
#: names the shards of data where it lies
INSTALLED = {"torch", "safetensors", "boto3", "botocore", "redis", "braceexpand"}
#: and what it installs when the build needs it: Parquet's reader, for Parquet files in place (the compiler
#: adds it; shards.py imports it only when it reads one)
INSTALLED_WHEN_NEEDED = {PARQUET_READER}


def module_name(path: Path, root: Path = ROOT) -> str:
    """ir/plan.py -> cloudless.ir.plan; runtimes/function/__init__.py -> cloudless.runtimes.function."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["cloudless", *parts])


def is_module(name: str, root: Path = ROOT) -> bool:
    """Whether a dotted name is one of the repository's modules or packages."""
    parts = name.split(".")
    if parts[0] != "cloudless" or len(parts) < 2:
        return False
    where = root.joinpath(*parts[1:])
    return where.with_suffix(".py").is_file() or (where / "__init__.py").is_file()


def imports(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """(line, module) of every import in a file, relative imports resolved within its package."""
    found = []
    own = module_name(path, root).split(".")
    package = own if path.name == "__init__.py" else own[:-1]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            # `from ..ir import protocol` imports the module cloudless.ir.protocol, not only the package
            names = [f"{module}.{alias.name}" for alias in node.names]
            submodules = [name for name in names if is_module(name, root)]
            found.extend((node.lineno, name) for name in submodules or [module])
    return found


def sources(root: Path = ROOT, packages: Iterable[str] = PACKAGES) -> list[Path]:
    return sorted(path for package in packages for path in (root / package).rglob("*.py"))


def import_graph(root: Path = ROOT, packages: Iterable[str] = PACKAGES) -> nx.DiGraph:
    """Our modules, an edge from each to every module of ours it imports (with the line of the first)."""
    graph = nx.DiGraph()
    for path in sources(root, packages):
        name = module_name(path, root)
        graph.add_node(name, path=path.relative_to(root))
        for line, module in imports(path, root):
            if is_module(module, root) and module != name and not graph.has_edge(name, module):
                graph.add_edge(name, module, line=line)
    return graph


def cycles(graph: nx.DiGraph) -> list[str]:
    """One cycle of each group of modules that import each other, spelled with its files and lines."""
    found = []
    for group in sorted(nx.strongly_connected_components(graph), key=sorted):
        if len(group) > 1:
            cycle = nx.find_cycle(graph.subgraph(group), source=min(group))
            steps = [f"{graph.nodes[a]['path']}:{graph.edges[a, b]['line']} imports {b}" for a, b in cycle]
            found.append(" -> ".join(steps))
    return found


def allowed(module: str, prefixes: Iterable[str]) -> bool:
    """Whether a module of ours is one of these packages or rooms (`runtimes.storage`), or inside one."""
    inner = module.removeprefix("cloudless.")
    return any(inner == prefix or inner.startswith(prefix + ".") for prefix in prefixes)


def room(module: str, package: str) -> int:
    """The index of a module's room in its package (0 at the top)."""
    best = max(
        (
            (len(prefix), index)
            for index, prefixes in enumerate(ROOMS[package])
            for prefix in prefixes
            if module == prefix or module.startswith(prefix + ".")
        ),
        default=None,
    )
    assert best is not None, f"{module}: in no room of {package}; add it to ROOMS"
    return best[1]


def test_no_import_cycle() -> None:
    assert cycles(import_graph()) == []


def test_the_cycle_check_finds_a_planted_cycle(tmp_path: Path) -> None:
    (tmp_path / "compiler" / "planner").mkdir(parents=True)
    (tmp_path / "compiler" / "__init__.py").write_text("")
    (tmp_path / "compiler" / "planner" / "__init__.py").write_text("")
    (tmp_path / "compiler" / "planner" / "a.py").write_text("from . import b\n")
    (tmp_path / "compiler" / "planner" / "b.py").write_text("import os\n\n\ndef f():\n    from .c import g\n")
    (tmp_path / "compiler" / "planner" / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from cloudless.compiler.planner.a import x\n"
    )
    assert cycles(import_graph(tmp_path, ["compiler"])) == [
        "compiler/planner/a.py:1 imports cloudless.compiler.planner.b -> "
        "compiler/planner/b.py:5 imports cloudless.compiler.planner.c -> "
        "compiler/planner/c.py:3 imports cloudless.compiler.planner.a"
    ]


@pytest.mark.parametrize("package", PACKAGES)
def test_packages_import_one_way(package: str) -> None:
    wrong = [
        f"{path.relative_to(ROOT)}:{line}: imports {module}"
        for path in sources(packages=[package])
        for line, module in imports(path)
        if module.startswith("cloudless.") and not allowed(module, ALLOWED[package])
    ]
    assert wrong == []


@pytest.mark.parametrize("package", sorted(ROOMS))
def test_rooms_import_down_only(package: str) -> None:
    graph = import_graph()
    wrong = [
        f"{graph.nodes[a]['path']}:{graph.edges[a, b]['line']}: imports {b}, a room above it"
        for a, b in graph.edges
        if a.split(".")[1] == package == b.split(".")[1] and room(a, package) > room(b, package)
    ]
    assert wrong == []


def test_the_room_check_catches_an_upward_import() -> None:
    assert room("cloudless.runtimes.function.worker", "runtimes") > room("cloudless.runtimes.control.run", "runtimes")
    assert room("cloudless.compiler.frontend.trace", "compiler") > room("cloudless.compiler.planner.plan", "compiler")
    assert room("cloudless.compiler.errors", "compiler") > room("cloudless.compiler.frontend.trace", "compiler")
    assert room("cloudless.compiler.cli", "compiler") == 0 < room("cloudless.compiler.lower", "compiler")


def test_vendored_modules_import_only_what_ships_with_them() -> None:
    """Every module of the vendored folders (and the vendored ir modules) imports the standard library, what
    the image installs, and vendored modules only: a package runs with nothing else of Cloudless."""
    stdlib = set(sys.stdlib_module_names)
    shipped = {module_name(ROOT / path.removeprefix("cloudless/")) for path in runtime_sources()}
    folders = {path.rsplit("/", 1)[0] for path in runtime_sources()}
    assert folders == {"cloudless/runtimes", "cloudless/ir", *(f"cloudless/{f}" for f in VENDORED_FOLDERS)}
    assert {f"cloudless.ir.{name}".removesuffix(".__init__") for name in VENDORED_IR} <= shipped
    outside = stdlib | INSTALLED | INSTALLED_WHEN_NEEDED | {"__future__"}
    wrong = []
    for path in runtime_sources():
        file = ROOT / path.removeprefix("cloudless/")
        for line, module in imports(file):
            top = module.split(".")[0]
            ok = module in shipped if top == "cloudless" else top in outside
            if not ok:
                wrong.append(f"{file.relative_to(ROOT)}:{line}: imports {module}")
    assert wrong == []


def test_every_module_of_a_vendored_folder_ships() -> None:
    """codegen vendors the folders, not a list: a module added to runtimes/function/ ships without more."""
    expected = {
        f"cloudless/{path.relative_to(ROOT).as_posix()}"
        for folder in VENDORED_FOLDERS
        for path in (ROOT / folder).glob("*.py")
    }
    assert expected <= set(runtime_sources())


def test_imports_resolve_relative_names(tmp_path: Path) -> None:
    (tmp_path / "runtimes" / "function").mkdir(parents=True)
    (tmp_path / "runtimes" / "function" / "worker.py").write_text("")
    bad = tmp_path / "compiler" / "bad.py"
    bad.parent.mkdir()
    bad.write_text(
        "from cloudless.runtimes.function.worker import StageWorker\nfrom .lower import slug\n"
        "from ..runtimes.function import worker\n"
    )
    assert imports(bad, tmp_path) == [
        (1, "cloudless.runtimes.function.worker"),
        (2, "cloudless.compiler.lower"),
        (3, "cloudless.runtimes.function.worker"),
    ]


def test_the_compiler_may_import_the_storage_room_and_no_other_of_the_runtime() -> None:
    assert allowed("cloudless.runtimes.storage.shards", ALLOWED["compiler"])
    assert not allowed("cloudless.runtimes.control.staging", ALLOWED["compiler"])
    assert not allowed("cloudless.runtimes.storage_extra", ALLOWED["compiler"])
    assert not allowed("cloudless.runtimes", ALLOWED["compiler"])
