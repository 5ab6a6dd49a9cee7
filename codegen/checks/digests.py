"""The last checks: every file has the digest cloudless-build.json recorded, no file a run or a
deployment reads is missing from it, and no generated deployment file holds a credential."""

from __future__ import annotations

import re
from pathlib import Path

from ...ir.files import BUILD_MARKER
from ...ir.workflow import Workflow
from .base import BuildContext, build_relative, fail

#: Things that look like credentials; none may appear in a generated file.
_SECRET_PATTERNS = (
    re.compile(r"AKIA[0-9A-Z]{16}"),
    re.compile(r"ASIA[0-9A-Z]{16}"),
    re.compile(r"aws_secret_access_key", re.IGNORECASE),
    re.compile(r"aws_session_token", re.IGNORECASE),
    re.compile(r"password\s*[:=]", re.IGNORECASE),
)


def _deployment_file(path: str) -> bool:
    """A file the deployment checks read (their messages explain an edit better than its digest)."""
    return path == "samconfig.toml" or (path.startswith("regions/") and path.count("/") == 2)


def check_digests(context: BuildContext, workflow: Workflow, packages: bool, *, deployment: bool) -> None:
    """Every file cloudless-build.json lists has its digest, and every file a deployment or a run reads is
    listed: a package folder is deployed whole (its image copies every file in it). Python's own caches
    (__pycache__, written when a local run imports the vendored runtime) are not the build's. In two passes:
    the deployment files (`deployment`) after their own checks, every other file before them."""
    package_roots = tuple(f"{function.package}/" for _, function in workflow.functions())
    for path, digest in sorted(context.manifest.items()):
        if _deployment_file(path) != deployment or (not packages and path.startswith(package_roots)):
            continue
        actual = context.digest(path)
        if actual is None:
            fail(path, "(file)", f"missing (listed in {BUILD_MARKER}): deleted after the compile; recompile")
        if actual != digest:
            fail(path, "(digest)", f"differs from {BUILD_MARKER} (edited or corrupted after the compile; recompile)")
    read = [context.root / name for name in ("workflow.yaml", "plan.json", "samconfig.toml")]
    regions = context.root / "regions"
    if regions.is_dir():
        read += [p for p in regions.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    for file in sorted(read):
        relative = build_relative(context.root, file)
        if file.is_file() and relative not in context.manifest and _deployment_file(relative) == deployment:
            inside = relative.startswith(package_roots) or "/functions/" in relative
            why = "a package folder is deployed whole: remove it, or recompile" if inside else "remove it, or recompile"
            fail(relative, "(file)", f"not in {BUILD_MARKER}: {why}")


def check_no_secrets(build: Path, regions: list[str]) -> None:
    """No credentials in any generated deployment file (the function packages are checked by their writer)."""
    files = [build / "workflow.yaml", build / "samconfig.toml"]
    for name in regions:
        files += [build / "regions" / name / leaf for leaf in ("stack.yaml", "template.yaml", "statemachine.asl.json")]
    for path in files:
        if not path.exists():
            continue
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            for pattern in _SECRET_PATTERNS:
                if pattern.search(line):
                    fail(build_relative(build, path), f"line {number}", f"looks like a credential ({pattern.pattern})")
