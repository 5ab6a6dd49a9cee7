"""The layers import one way (shared/DESIGN.md): ir <- compiler/codegen, ir <- runtimes; codegen never
imports the compiler, and what a function package vendors imports nothing it does not ship."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from cloudless.codegen.package import VENDORED_MODULES

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("ir", "compiler", "codegen", "runtimes")
#: what each layer may import of Cloudless
ALLOWED = {
    "ir": {"ir"},
    "compiler": {"ir", "compiler", "codegen"},
    "codegen": {"ir", "codegen"},
    "runtimes": {"ir", "runtimes"},
}
#: the runtime modules that run inside a function may import only the ir modules vendored with them
VENDORED_IR = {f"cloudless.ir.{name}" for name in VENDORED_MODULES["ir"] if name != "__init__"} | {"cloudless.ir"}


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in a file, relative imports resolved within its package."""
    found = []
    # the package's folders under the repository (codegen/checks -> cloudless.codegen.checks)
    layer = [p for p in path.parents if p.parent == ROOT]
    package = ["cloudless", *(path.parent.relative_to(ROOT).parts if layer else (path.parent.name,))]
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
            submodules = [f"{module}.{alias.name}" for alias in node.names if is_module(f"{module}.{alias.name}")]
            found.extend((node.lineno, name) for name in submodules or [module])
    return found


def is_module(name: str) -> bool:
    """Whether a dotted name is one of this repository's modules (cloudless.ir.protocol -> ir/protocol.py)."""
    parts = name.split(".")
    return parts[0] == "cloudless" and len(parts) > 2 and (ROOT.joinpath(*parts[1:]).with_suffix(".py")).is_file()


def layer_files(layer: str) -> list[Path]:
    return sorted((ROOT / layer).rglob("*.py"))  # sub-packages too (codegen/checks/)


@pytest.mark.parametrize("layer", LAYERS)
def test_imports_go_one_way(layer: str) -> None:
    wrong = [
        f"{path.relative_to(ROOT)}:{line}: imports {module}"
        for path in layer_files(layer)
        for line, module in imports(path)
        if module.startswith("cloudless.") and module.split(".")[1] not in ALLOWED[layer]
    ]
    assert wrong == []


def test_vendored_modules_import_only_what_ships_with_them() -> None:
    stdlib = set(sys.stdlib_module_names)
    # what a function's image installs (requirements.txt): torch, safetensors, and the storage clients
    installed = {"torch", "safetensors", "boto3", "botocore", "redis"}
    wrong = []
    for package, modules in VENDORED_MODULES.items():
        for name in modules:
            path = ROOT / package / f"{name}.py"
            for line, module in imports(path):
                top = module.split(".")[0]
                if module.startswith("cloudless."):
                    ok = module in VENDORED_IR or module.startswith("cloudless.runtimes")
                    if module.startswith("cloudless.runtimes."):
                        ok = module.split(".")[2] in VENDORED_MODULES["runtimes"]
                else:
                    ok = top in stdlib or top in installed or top == "__future__"
                if not ok:
                    wrong.append(f"{path.relative_to(ROOT)}:{line}: imports {module}")
    assert wrong == []


def test_the_check_catches_a_wrong_import(tmp_path: Path) -> None:
    bad = tmp_path / "compiler" / "bad.py"
    bad.parent.mkdir()
    bad.write_text(
        "from cloudless.runtimes.worker import StageWorker\nfrom .lower import slug\nfrom ..runtimes import worker\n"
    )
    assert imports(bad) == [
        (1, "cloudless.runtimes.worker"),
        (2, "cloudless.compiler.lower"),
        (3, "cloudless.runtimes.worker"),
    ]
