"""requirements/lock.txt pins what scripts/setup.sh installs: it must agree with pyproject.toml (every
requirement locked, at a version the requirement admits) and with the venv the tests run in."""

from __future__ import annotations

import re
import sys
from importlib import metadata
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "requirements" / "lock.txt"
#: installed by scripts/setup.sh itself (the CPU build), never from the lock
UNLOCKED = {"torch"}
#: the extras setup.sh installs and scripts/lock.sh locks
EXTRAS = ("test", "samples")


def locked() -> dict[str, tuple[Version, list[str]]]:
    """The lock's pins: name -> (version, hashes)."""
    pins: dict[str, tuple[Version, list[str]]] = {}
    for entry in re.split(r"\n(?=\S)", LOCK.read_text()):
        match = re.match(r"([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", entry)
        if match:
            pins[canonicalize_name(match.group(1))] = (
                Version(match.group(2)),
                re.findall(r"--hash=sha256:(\w+)", entry),
            )
    return pins


def required() -> list[Requirement]:
    """What pyproject.toml and requirements/tools.in ask for, for this Python."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = list(project["dependencies"])
    for extra in EXTRAS:
        lines += project["optional-dependencies"][extra]
    tools = (ROOT / "requirements" / "tools.in").read_text().splitlines()
    lines += [line for line in tools if line.strip() and not line.startswith("#")]
    requirements = [Requirement(line) for line in lines]
    return [r for r in requirements if r.marker is None or r.marker.evaluate()]


def test_every_requirement_is_locked_at_a_version_it_admits() -> None:
    pins = locked()
    assert len(pins) > 50, "the lock holds the whole tree, not only the direct requirements"
    for requirement in required():
        name = canonicalize_name(requirement.name)
        if name in UNLOCKED:
            assert name not in pins, f"{name} is installed explicitly, not from the lock"
            continue
        assert name in pins, f"pyproject.toml asks for {requirement} and the lock has no {name}: bash scripts/lock.sh"
        version, _ = pins[name]
        assert requirement.specifier.contains(version, prereleases=True), (
            f"pyproject.toml asks for {requirement}, the lock pins {name}=={version}: bash scripts/lock.sh"
        )


def test_every_pin_has_hashes() -> None:
    for name, (version, hashes) in locked().items():
        assert hashes and all(len(h) == 64 for h in hashes), f"{name}=={version} has no sha256 hash"


@pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason="the lock is for Python 3.11")
def test_the_venv_holds_the_locked_versions() -> None:
    """scripts/setup.sh puts back the locked version of anything changed in the venv since."""
    for name, (version, _) in locked().items():
        try:
            installed = Version(metadata.version(name))
        except metadata.PackageNotFoundError:
            pytest.fail(f"{name}=={version} is locked but not installed: bash scripts/setup.sh")
        assert installed == version, f"{name} {installed} is installed, the lock pins {version}: bash scripts/setup.sh"


@pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason="the lock is for Python 3.11")
def test_setup_skips_pip_only_for_a_venv_that_holds_the_lock(monkeypatch: pytest.MonkeyPatch) -> None:
    """scripts/setup.sh leaves a venv alone only when scripts/venv_matches.py finds nothing to put back."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import venv_matches

    torch_version = re.search(r"^TORCH_VERSION=(\S+)$", (ROOT / "scripts" / "setup.sh").read_text(), re.M)
    assert torch_version is not None
    assert venv_matches.differences(torch_version.group(1)) == []  # the venv setup.sh made for this run
    pins = venv_matches.locked()
    monkeypatch.setattr(venv_matches, "locked", lambda: {**pins, "jinja2": "0.1"})
    assert venv_matches.differences(torch_version.group(1)) == [
        f"jinja2: {metadata.version('jinja2')} installed, 0.1 locked"
    ]
    monkeypatch.setattr(venv_matches, "locked", lambda: pins)
    assert venv_matches.differences("1.0.0") == [f"torch: {metadata.version('torch')} installed, 1.0.0 wanted"]
