"""Golden-file tests of the whole generated tree, and the build's determinism and atomicity.

Each case compiles a model with the block times of its golden ir/blocks.json (`--profile`), so the
plan, and with it every file, is reproducible. Weights are compared by SHA-256 (the golden holds
`<file>.sha256`). Regenerate with `UPDATE_GOLDENS=1 pytest tests/test_golden.py` and review the diff.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import pytest
import yaml

from cloudless.codegen.report_figures import svg_summary
from cloudless.ir.files import BUILD_MARKER

from .conftest import MODELS, SAMPLES

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = Path(__file__).resolve().parent / "golden"
HASHED = (".safetensors",)
#: the vendored runtime is a copy of runtimes/, a package's user/ one of the model file and its neighbours:
#: the golden keeps their hashes, not another copy of their text
HASHED_FOLDERS = ("/cloudless/", "/user/")

CASES: dict[str, tuple[Path, list[str]]] = {
    # the README's sample, as the demo compiles it
    "mlp_digits": (SAMPLES / "mlp_digits.py", ["--stages", "2"]),
    # tied embeddings across stages, BatchNorm buffers, two inputs, a dict output; the fastest plan
    "tricky_time": (MODELS / "tricky.py", ["--objective", "time"]),
    # compute-heavy, SAM only (OpenFaaS CE's 5 replicas per function would cap it): the fastest plan
    # pipelines over two stages of eight replicas each
    "wide_mlp_time": (MODELS / "wide_mlp.py", ["--objective", "time", "--blocks", "8", "--target", "sam"]),
    # data in two regions: both train, some data moves, model averaging between them
    "mlp_digits_geo": (
        SAMPLES / "mlp_digits_geo.py",
        ["--regions", "aws-us-east-1,aws-eu-west-1", "--objective", "time", "--sync", "model-average"],
    ),
}


def tree(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` as the golden stores it (weights and the vendored runtime by hash)."""
    files: dict[str, bytes] = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        name = path.relative_to(folder).as_posix()
        data = path.read_bytes()
        if not name.endswith(".sha256") and (name.endswith(HASHED) or any(f in name for f in HASHED_FOLDERS)):
            files[name + ".sha256"] = (hashlib.sha256(data).hexdigest() + "\n").encode()
        else:
            files[name] = data
    return files


def comparable(name: str, data: bytes) -> str:
    """What of a golden file must match. Files written by a library the project does not pin are
    compared by what they say, so that an upgrade's reformatting is not a failure: the pictures
    (matplotlib) by `svg_summary` (their texts, bars and spans), workflow.yaml (PyYAML) by its
    content; and so the marker (cloudless-build.json) by its content without those files' digests.
    Everything else, and every file in `test_two_compiles_are_byte_identical`, byte for byte."""
    if name.endswith(".svg"):
        return svg_summary(data)
    if name == "workflow.yaml":
        return json.dumps(yaml.safe_load(data), indent=1, sort_keys=True)
    if name == BUILD_MARKER:
        marker = json.loads(data)
        marker["files"] = {
            path: digest
            for path, digest in marker["files"].items()
            if not (path.endswith(".svg") or path == "workflow.yaml")
        }
        return json.dumps(marker, indent=1, sort_keys=True)
    return data.decode(errors="replace")


def compile_case(compile_cli, case: str, output: Path) -> None:
    """Compiles from the repository's root with the model's relative path, as a user would type it
    (workflow.yaml records the path as given)."""
    model, options = CASES[case]
    golden_profile = GOLDEN / case / "ir" / "blocks.json"
    profile = ["--profile", str(golden_profile)] if golden_profile.exists() else ["--repeats", "1"]
    here = Path.cwd()
    os.chdir(ROOT)
    try:
        code, _, stderr = compile_cli(model.relative_to(ROOT).as_posix(), "-o", str(output), "-q", *profile, *options)
    finally:
        os.chdir(here)
    assert code == 0, stderr


CREDENTIALS = re.compile(
    rb"AKIA[0-9A-Z]{16}|ASIA[0-9A-Z]{16}|aws_secret_access_key\s*[=:]|aws_session_token\s*[=:]"
    rb"|-----BEGIN [A-Z ]*PRIVATE KEY-----|password\s*[=:]\s*\S|secret_key\s*[=:]\s*\S",
    re.IGNORECASE,
)


@pytest.mark.parametrize("case", list(CASES))
def test_generated_tree_matches_golden_and_holds_no_credentials(
    case: str, compile_cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Credentials in the compiler's own environment must not leak into what it writes.
    # Made up here, not committed as literals (a fake key still looks like a key to scanners).
    key_id, secret = "AKIA" + "Q" * 16, "fake-" + "s" * 35
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    compile_case(compile_cli, case, tmp_path / "build")
    for path in (tmp_path / "build").rglob("*"):
        if path.is_file() and not path.name.endswith(".safetensors"):
            data = path.read_bytes()
            assert not CREDENTIALS.search(data), f"{path.relative_to(tmp_path)}: {CREDENTIALS.search(data)}"
            assert key_id.encode() not in data and secret.encode() not in data
    got = tree(tmp_path / "build")
    if os.environ.get("UPDATE_GOLDENS") == "1":
        shutil.rmtree(GOLDEN / case, ignore_errors=True)
        for name, data in got.items():
            (GOLDEN / case / name).parent.mkdir(parents=True, exist_ok=True)
            (GOLDEN / case / name).write_bytes(data)
        return
    assert (GOLDEN / case).is_dir(), f"no golden for {case}: run UPDATE_GOLDENS=1 pytest {__file__}"
    expected = tree(GOLDEN / case)
    assert sorted(got) == sorted(expected), "files differ: " + ", ".join(sorted(set(got) ^ set(expected))[:10])
    for name in expected:
        if comparable(name, got[name]) != comparable(name, expected[name]):
            diff = difflib.unified_diff(
                comparable(name, expected[name]).splitlines(),
                comparable(name, got[name]).splitlines(),
                f"golden/{case}/{name}",
                f"build/{name}",
                lineterm="",
                n=1,
            )
            pytest.fail(f"{name} differs from the golden (UPDATE_GOLDENS=1 to accept):\n" + "\n".join(list(diff)[:40]))


def test_two_compiles_are_byte_identical(compile_cli, tmp_path: Path) -> None:
    """With the same profile, every byte of the build repeats, weights included."""
    compile_case(compile_cli, "wide_mlp_time", tmp_path / "a")
    compile_case(compile_cli, "wide_mlp_time", tmp_path / "b")
    a = {p.relative_to(tmp_path / "a"): p.read_bytes() for p in (tmp_path / "a").rglob("*") if p.is_file()}
    b = {p.relative_to(tmp_path / "b"): p.read_bytes() for p in (tmp_path / "b").rglob("*") if p.is_file()}
    assert a.keys() == b.keys()
    assert [name for name in a if a[name] != b[name]] == []


def test_a_failed_compile_leaves_the_previous_build(compile_cli, model_file, tmp_path: Path) -> None:
    build = tmp_path / "build"
    compile_case(compile_cli, "mlp_digits", build)
    before = tree(build)
    broken = model_file("import torch\n\ndef build_model():\n    return torch.nn.Linear(2, 2)\n")
    code, _, stderr = compile_cli(str(broken), "-o", str(build), "-q")
    assert code == 2 and "example_inputs" in stderr
    assert tree(build) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["build", "model.py"]  # no staging folder left


def test_check_command_passes_a_build_and_names_a_broken_key(compile_cli, tmp_path: Path) -> None:
    build = tmp_path / "build"
    compile_case(compile_cli, "mlp_digits", build)
    code, stdout, _ = compile_cli("--check", str(build))
    assert code == 0 and "every check passed" in stdout
    stack = build / "regions" / "aws-us-east-1" / "stack.yaml"
    stack.write_text(stack.read_text().replace("lang: python3-http-debian", "lang: python3-http-debian\n    langg: x"))
    code, _, stderr = compile_cli("--check", str(build))
    assert code == 2
    assert "regions/aws-us-east-1/stack.yaml" in stderr and "functions/mlp-digits-s0" in stderr and "langg" in stderr
