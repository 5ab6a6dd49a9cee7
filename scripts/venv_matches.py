"""Exit 0 when .venv already holds exactly what scripts/setup.sh would install, so that it can skip pip.

What it compares: every package of requirements/lock.txt at its locked version, torch at the version
setup.sh names, and Cloudless installed in editable mode from this clone with the pyproject.toml it was
installed from (setup.sh records its SHA-256 after the install). Any difference (a package upgraded or
downgraded in the venv, a new lock, an edited pyproject) exits 1 and setup.sh runs pip as before.
Run with the venv's python: python scripts/venv_matches.py TORCH_VERSION
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: where setup.sh records the SHA-256 of the pyproject.toml the editable install was made from
PYPROJECT_STAMP = Path(sys.prefix) / "cloudless-pyproject.sha256"


def normalised(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def locked() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "requirements" / "lock.txt").read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s\\;]+)", line)
        if match:
            pins[normalised(match.group(1))] = match.group(2)
    return pins


def differences(torch_version: str) -> list[str]:
    from packaging.version import InvalidVersion, Version  # locked: a venv without it is set up again

    installed = {normalised(d.metadata["Name"]): d.version for d in metadata.distributions()}

    def same(have: str | None, want: str) -> bool:
        try:
            return have is not None and Version(have) == Version(want)
        except InvalidVersion:
            return have == want

    found = [
        f"{name}: {installed.get(name)} installed, {version} locked"
        for name, version in sorted(locked().items())
        if not same(installed.get(name), version)
    ]
    if not same(installed.get("torch", "").split("+")[0] or None, torch_version):
        found.append(f"torch: {installed.get('torch')} installed, {torch_version} wanted")
    try:
        url = json.loads(metadata.distribution("cloudless").read_text("direct_url.json") or "{}")
    except metadata.PackageNotFoundError:
        return [*found, "cloudless: not installed"]
    if url.get("url") != ROOT.as_uri() or not url.get("dir_info", {}).get("editable"):
        found.append(f"cloudless: installed from {url.get('url')}, not this clone in editable mode")
    digest = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
    if not PYPROJECT_STAMP.is_file() or PYPROJECT_STAMP.read_text().strip() != digest:
        found.append("cloudless: installed from another pyproject.toml")
    return found


if __name__ == "__main__":
    sys.exit(1 if differences(sys.argv[1]) else 0)
