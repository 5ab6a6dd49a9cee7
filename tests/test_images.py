"""The images install: every generated requirements file resolves, with pip's own resolver (`pip install
--dry-run --report`, nothing installed), for the Python and the C library of the image that installs it:
Lambda's `public.ecr.aws/lambda/python:3.12` (Amazon Linux 2023, glibc 2.34) and OpenFaaS's
`python:3.12-slim-bookworm` (glibc 2.36), on x86_64 (and aarch64 for the hashed PyPI pins).

pip runs with the machine's way of reaching an index (its CA bundle, proxy, trusted hosts: `pip config
list`), but with no index of the machine's configuration (`PIP_CONFIG_FILE=/dev/null`, no PIP_* variables):
each file must resolve from the indexes it names itself, as in the image build. Where PyTorch's CPU index
cannot be reached (machines that reach PyPI only, through a package mirror), the torch pin is checked against
PyPI instead: the same torch release, whose Linux wheels carry the same tags as the CPU builds (the
`+cpu` local version is PyTorch's index's only), and the CPU build's own dependencies; and the files' other
pins resolve as written. Without PyPI there is nothing to check against, and the tests say so as their skip
reason. Slow: each resolution is a few seconds of network.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from functools import cache
from importlib.metadata import requires, version
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

from cloudless.codegen.images import LAMBDA_GLIBC, OPENFAAS_GLIBC, PYTHON_VERSION
from cloudless.codegen.package import PYPI_INDEX, PYPI_PINS, TORCH_INDEX, render_function_package, torch_release
from cloudless.codegen.platforms import render_region

from .test_platforms import EAST, make_workflow

pytestmark = pytest.mark.slow

#: the C library of the python3.11 Lambda image (Amazon Linux 2), where pip finds no torch 2.13
AMAZON_LINUX_2_GLIBC = (2, 26)
#: pip settings of this machine that say how to reach an index, not which index to use
NETWORK_SETTINGS = ("cert", "client-cert", "proxy", "trusted-host")
#: what pip prints when it could not reach an index at all (as opposed to an index that lacks a file)
UNREACHABLE = re.compile(
    r"NameResolutionError|Failed to resolve|Name or service not known|Temporary failure in name resolution|"
    r"Failed to establish a new connection|Connection refused|Network is unreachable|ProxyError|ConnectTimeout|"
    r"Read timed out|SSLError"
)


@cache
def network_options() -> tuple[str, ...]:
    """The machine's pip network settings (configuration files and PIP_* variables) as options."""
    listed = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=False
    ).stdout
    options: dict[str, str] = {}
    for line in listed.splitlines():
        match = re.fullmatch(r"[^.]*\.([a-z-]+)='(.*)'", line.strip())
        if match and match.group(1) in NETWORK_SETTINGS:
            options[match.group(1)] = match.group(2)  # later lines (the environment) win
    found: list[str] = []
    for key, value in sorted(options.items()):
        for item in value.split() if key == "trusted-host" else [value]:
            found += [f"--{key}", item]
    return tuple(found)


def pip(*args: str) -> subprocess.CompletedProcess[str]:
    """pip with none of the machine's index settings: only the network ones, and what `args` say."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    environment["PIP_CONFIG_FILE"] = os.devnull
    command = [sys.executable, "-m", "pip", *args, *network_options()]
    command += ["--disable-pip-version-check", "--no-input", "--timeout", "30", "--retries", "1"]
    return subprocess.run(command, capture_output=True, text=True, env=environment, timeout=300, check=False)


def platforms(glibc: tuple[int, int], arch: str) -> list[str]:
    """`--platform` options for every manylinux tag a glibc of this version accepts (pip does not expand a
    perennial manylinux_2_X tag to the older ones by itself)."""
    major, minor = glibc
    tags = [f"manylinux_{major}_{m}_{arch}" for m in range(minor, 4, -1)]
    tags += [f"{legacy}_{arch}" for m, legacy in ((17, "manylinux2014"), (12, "manylinux2010"), (5, "manylinux1"))]
    return [option for tag in tags for option in ("--platform", tag)]


def resolve(
    requirements: str, tmp_path: Path, glibc: tuple[int, int], arch: str = "x86_64", *extra: str
) -> tuple[subprocess.CompletedProcess[str], list[dict[str, Any]]]:
    """Resolve a requirements file's text for CPython PYTHON_VERSION on that glibc and arch: pip's answer,
    and what it would install (the report's entries; empty when it failed)."""
    file = tmp_path / f"requirements-{len(list(tmp_path.iterdir()))}.txt"
    file.write_text(requirements)
    report = tmp_path / f"{file.stem}.report.json"
    answer = pip(
        "install",
        "--dry-run",
        "--ignore-installed",
        "--only-binary=:all:",
        "--python-version",
        PYTHON_VERSION,
        "--implementation",
        "cp",
        *platforms(glibc, arch),
        "--report",
        str(report),
        "-r",
        str(file),
        *extra,
    )
    installs = json.loads(report.read_text())["install"] if answer.returncode == 0 else []
    return answer, installs


@cache
def reachable(index: str, project: str) -> str | None:
    """None when pip reaches `index` (it lists `project`'s versions); else why not, from pip's own words."""
    answer = pip("index", "versions", project, "--index-url", index)
    if answer.returncode == 0:
        return None
    reason = UNREACHABLE.search(answer.stdout + answer.stderr)
    return f"pip cannot reach {index} from this machine ({reason.group(0) if reason else answer.stderr.strip()[-200:]})"


def generated_requirements() -> dict[str, str]:
    """Every requirements file the packages of a build get (the test workflow's, both regions), by name,
    each once: they differ only in the comment naming their function."""
    workflow = make_workflow()
    found: dict[str, set[str]] = {}
    for region in workflow.regions:
        for function in region.functions:
            files = render_function_package(
                workflow,
                region.name,
                function,
                stage_source="",
                weights={},
                loss_source="",
                torch_version=torch_release(),
            )
            for path, data in files.items():
                name = path.rsplit("/", 1)[1]
                if name.startswith("requirements"):
                    text = "\n".join(line for line in data.decode().splitlines() if not line.startswith("#"))
                    found.setdefault(name, set()).add(text + "\n")
    assert sorted(found) == ["requirements-pypi.txt", "requirements-torch.txt", "requirements.txt"]
    assert all(len(texts) == 1 for texts in found.values()), "packages' requirements differ beyond the comment"
    return {name: texts.pop() for name, texts in found.items()}


def needs(index: str, project: str) -> None:
    why = reachable(index, project)
    if why:
        pytest.skip(why)


def installed(entries: list[dict[str, Any]]) -> dict[str, str]:
    return {canonicalize_name(entry["metadata"]["name"]): entry["metadata"]["version"] for entry in entries}


def wheel(entries: list[dict[str, Any]], name: str) -> str:
    (url,) = [e["download_info"]["url"] for e in entries if canonicalize_name(e["metadata"]["name"]) == name]
    return str(url.rsplit("/", 1)[1].split("#")[0])


def manylinux_glibc(filename: str) -> tuple[int, int]:
    """The newest glibc a manylinux wheel's tags ask for (the least of its platform tags' versions)."""
    versions = []
    for tag in parse_wheel_filename(filename.replace("%2B", "+"))[3]:
        match = re.fullmatch(r"manylinux_(\d+)_(\d+)_\w+", tag.platform)
        legacy = {"manylinux2014": (2, 17), "manylinux2010": (2, 12), "manylinux1": (2, 5)}
        if match:
            versions.append((int(match.group(1)), int(match.group(2))))
        elif tag.platform.rsplit("_", 1)[0] in legacy:
            versions.append(legacy[tag.platform.rsplit("_", 1)[0]])
        elif tag.platform == "any":
            versions.append((0, 0))
    return min(versions)


# --- PyPI's pins: as written, hashes and all ------------------------------------------------------------


@pytest.mark.parametrize("arch", ["x86_64", "aarch64"])
def test_the_pypi_pins_resolve_with_their_hashes_for_the_lambda_image(tmp_path: Path, arch: str) -> None:
    """requirements-pypi.txt, the Dockerfile's `pip install --require-hashes` step, as written: every pin
    has a file for CPython 3.12 on Amazon Linux 2023 whose hash is pinned, and nothing else is installed."""
    needs(PYPI_INDEX, "six")
    text = generated_requirements()["requirements-pypi.txt"]
    answer, entries = resolve(text, tmp_path, LAMBDA_GLIBC, arch, "--require-hashes")
    assert answer.returncode == 0, answer.stderr
    assert installed(entries) == {pin.name: pin.version for pin in PYPI_PINS}
    for entry in entries:
        assert entry["download_info"]["url"].startswith("https://"), entry["download_info"]
        assert manylinux_glibc(wheel(entries, canonicalize_name(entry["metadata"]["name"]))) <= LAMBDA_GLIBC


def test_a_pin_without_a_wheel_for_the_images_python_fails_the_check(tmp_path: Path) -> None:
    """The resolution above can fail: a version with no wheel for CPython 3.12 (or a hash that is no file of
    the pinned version) is refused."""
    needs(PYPI_INDEX, "six")
    text = generated_requirements()["requirements-pypi.txt"]
    answer, _ = resolve(text.replace("safetensors==0.8.0", "safetensors==0.2.8"), tmp_path, LAMBDA_GLIBC)
    assert answer.returncode != 0 and "safetensors" in answer.stderr
    pin = PYPI_PINS[1]
    answer, _ = resolve(text.replace(pin.hashes[0], "0" * 64), tmp_path, LAMBDA_GLIBC, "x86_64", "--require-hashes")
    assert answer.returncode != 0 and "hash" in answer.stderr.lower()


# --- torch: from PyTorch's CPU index, or the same release on PyPI -----------------------------------------


def test_torch_files_resolve_from_pytorch_s_cpu_index(tmp_path: Path) -> None:
    """requirements-torch.txt (Lambda) and requirements.txt (OpenFaaS, PyPI plus PyTorch's torch page) as
    written: torch's CPU build and its dependencies for CPython 3.12 on each image's glibc."""
    needs(TORCH_INDEX, "torch")
    needs(PYPI_INDEX, "six")
    files = generated_requirements()
    for name, glibc in (("requirements-torch.txt", LAMBDA_GLIBC), ("requirements.txt", OPENFAAS_GLIBC)):
        answer, entries = resolve(files[name], tmp_path, glibc)
        assert answer.returncode == 0, (name, answer.stderr)
        assert installed(entries)["torch"] == f"{torch_release()}+cpu", name
        assert manylinux_glibc(wheel(entries, "torch")) <= glibc


def versions_for(project: str, index: str, glibc: tuple[int, int], arch: str = "x86_64") -> list[str]:
    """The versions of `project` that `index` has a wheel of for CPython PYTHON_VERSION on that glibc and arch
    (`pip index versions`: the index's file list only, no download; PyPI's torch wheels are 500 MB and the
    mirror here serves no separate metadata files)."""
    answer = pip(
        "index",
        "versions",
        project,
        "--index-url",
        index,
        "--only-binary=:all:",
        "--python-version",
        PYTHON_VERSION,
        "--implementation",
        "cp",
        *platforms(glibc, arch),
    )
    if answer.returncode != 0:
        assert "No matching distribution found" in answer.stderr, answer.stderr
        return []
    match = re.search(r"Available versions: (.*)", answer.stdout)
    assert match, answer.stdout
    return match.group(1).split(", ")


def test_the_torch_release_has_wheels_for_the_images_and_none_for_amazon_linux_2() -> None:
    """The torch pin's release has a CPython 3.12 Linux wheel for Amazon Linux 2023 and Debian bookworm, and
    none for Amazon Linux 2 (glibc 2.26, the python3.11 Lambda image): the failure this image choice fixes.
    Checked on PyPI, whose torch wheels carry the same Python and platform tags as the CPU index's `+cpu`
    builds (manylinux_2_28), and also where PyTorch's index is reachable: there the CPU index itself."""
    needs(PYPI_INDEX, "six")
    release = torch_release()
    assert f"torch=={release}+cpu" in generated_requirements()["requirements-torch.txt"]
    indexes = [(PYPI_INDEX, release)]
    if reachable(TORCH_INDEX, "torch") is None:
        indexes.append((TORCH_INDEX, f"{release}+cpu"))
    for index, pinned in indexes:
        for glibc in (LAMBDA_GLIBC, OPENFAAS_GLIBC):
            assert pinned in versions_for("torch", index, glibc), (index, glibc)
        assert pinned not in versions_for("torch", index, AMAZON_LINUX_2_GLIBC), index
        # and not for the manylinux tags short of 2.28 either: the wheels need glibc 2.28
        assert pinned not in versions_for("torch", index, (2, 27)), index
        assert pinned in versions_for("torch", index, (2, 28)), index


def test_the_cpu_builds_dependencies_and_the_other_pins_resolve_for_openfaas(tmp_path: Path) -> None:
    """What the torch pin pulls in besides torch (the CPU build's own requirements, read from the torch
    installed here, which is that build) and requirements.txt's other pins, resolved together from PyPI for
    CPython 3.12 on Debian bookworm: where PyTorch's index is unreachable, the rest of the OpenFaaS file."""
    needs(PYPI_INDEX, "six")
    assert version("torch") == f"{torch_release()}+cpu"
    dependencies = [
        str(r) for r in map(Requirement, requires("torch") or []) if r.marker is None or "extra" not in str(r.marker)
    ]
    assert dependencies, "torch declares no dependencies?"
    lines = [line for line in generated_requirements()["requirements.txt"].splitlines() if line.strip()]
    assert lines[:2] == [f"--index-url {PYPI_INDEX}", f"--find-links {TORCH_INDEX}/torch/"]
    assert lines[2] == f"torch=={torch_release()}+cpu"
    text = "\n".join([lines[0], *lines[3:], *dependencies]) + "\n"
    answer, entries = resolve(text, tmp_path, OPENFAAS_GLIBC)
    assert answer.returncode == 0, answer.stderr
    resolved = installed(entries)
    assert {pin.name: resolved[pin.name] for pin in PYPI_PINS} == {pin.name: pin.version for pin in PYPI_PINS}
    assert {canonicalize_name(Requirement(d).name) for d in dependencies} <= set(resolved)


# --- one Python for both images ---------------------------------------------------------------------------


def test_both_images_run_the_python_the_pins_are_for() -> None:
    """The Lambda base image, the OpenFaaS template's PYTHON_VERSION build argument and the resolution above
    name the same Python."""
    import yaml

    workflow = make_workflow()
    function = workflow.region(EAST).functions[0]
    files = render_function_package(
        workflow, EAST, function, stage_source="", weights={}, loss_source="", torch_version=torch_release()
    )
    dockerfile = files[f"{function.package}/Dockerfile"].decode()
    assert re.findall(r"^FROM (\S+)$", dockerfile, re.M) == [f"public.ecr.aws/lambda/python:{PYTHON_VERSION}"]
    stack = yaml.safe_load(render_region(workflow, EAST, {"openfaas"})[f"regions/{EAST}/stack.yaml"])
    for entry in stack["functions"].values():
        assert entry["build_args"]["PYTHON_VERSION"] == PYTHON_VERSION
        assert entry["build_args"]["DEBIAN_OS"] == "slim-bookworm"
    assert LAMBDA_GLIBC >= (2, 28) and OPENFAAS_GLIBC >= (2, 28)  # torch 2.13's manylinux_2_28 wheels
