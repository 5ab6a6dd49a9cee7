"""Shared helpers: write a model file into a temporary folder, run the CLI in-process."""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "samples"
MODELS = Path(__file__).resolve().parent / "models"


@pytest.fixture
def model_file(tmp_path: Path) -> Callable[[str, str], Path]:
    """Write `source` (dedented) to tmp_path/name and return its path."""

    def write(source: str, name: str = "model.py") -> Path:
        path = tmp_path / name
        path.write_text(textwrap.dedent(source))
        return path

    return write


@pytest.fixture
def compile_cli(capsys: pytest.CaptureFixture[str]) -> Callable[..., tuple[int, str, str]]:
    """Run cloudless-compile in-process; returns (exit code, stdout, stderr)."""
    from cloudless.compiler.cli import main

    def run(*args: str) -> tuple[int, str, str]:
        code = main(list(args))
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    return run
