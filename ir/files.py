"""The IR's file forms: `workflow.yaml` and `plan.json` written, read and checked.

One YAML form (keys in the order written, block style, no aliases) so that two compiles of the same
plan give the same bytes. `check_workflow` adds what a JSON Schema cannot say: every dependency and
function named exists, the steps form a DAG, and stages are numbered 0..S-1 in each region.
(Not vendored into function packages: it needs yaml, jsonschema and networkx.)
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path, PurePosixPath
from typing import Any

import networkx as nx
import yaml

from .graph import dumps
from .plan import TrainingPlan
from .schema import SchemaError, read_yaml, validate
from .workflow import Workflow

#: the file at the root of every build folder: what wrote it, and every other file's digest. Its
#: presence is what lets `-o` replace a folder (an earlier build), and `--check` compares the digests.
BUILD_MARKER = "cloudless-build.json"


def file_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def build_manifest(files: dict[str, bytes]) -> bytes:
    """The marker's bytes for a build of `files` (paths relative to the build folder)."""
    digests = {path: file_digest(data) for path, data in sorted(files.items()) if path != BUILD_MARKER}
    return (json.dumps({"kind": "cloudless-build", "format": 1, "files": digests}, indent=1) + "\n").encode()


def read_manifest(build: Path) -> dict[str, str] | None:
    """The digests a build's marker records, by path; None if `build` has no (readable) marker."""
    try:
        document = json.loads((build / BUILD_MARKER).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(document, dict) or document.get("kind") != "cloudless-build":
        return None
    files = document.get("files")
    return dict(files) if isinstance(files, dict) else None


def digest_of(path: Path) -> str | None:
    """`file_digest` of the file at `path`, read in pieces (a package's weights may be large); None if
    it is not a file."""
    if not path.is_file():
        return None
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while piece := file.read(1 << 20):
            digest.update(piece)
    return "sha256:" + digest.hexdigest()


def build_difference(build: Path) -> str | None:
    """How `build` differs from what cloudless-compile wrote, in words naming the file (relative to the
    build): a listed file missing or with other bytes, or no readable manifest; None if every file its
    marker lists has its digest. Files it does not list (run outputs, logs, Python's caches) are not
    looked at. The first difference, in the marker's (sorted) order."""
    if not (build / BUILD_MARKER).is_file():
        return f"no {BUILD_MARKER} (the digests of what cloudless-compile wrote)"
    manifest = read_manifest(build)
    if manifest is None:
        return f"{BUILD_MARKER} is not a build manifest written by cloudless-compile"
    for path, digest in sorted(manifest.items()):
        parts = PurePosixPath(path).parts
        if PurePosixPath(path).is_absolute() or ".." in parts or not parts:
            return f"{BUILD_MARKER} lists {path!r}, not a path inside the build"
        actual = digest_of(build / path)
        if actual is None:
            return f"{path} is missing ({BUILD_MARKER} lists it)"
        if actual != digest:
            return f"{path} differs from what cloudless-compile wrote (its digest in {BUILD_MARKER})"
    return None


class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data: Any) -> bool:
        return True


def dump_yaml(document: Any) -> str:
    """The one YAML form of generated files: insertion order, block style, wide lines."""
    return str(yaml.dump(document, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=120))


def check_workflow(document: dict[str, Any], source: str = "workflow.yaml") -> None:
    """Raise SchemaError naming `source` and the key if the manifest is malformed."""
    validate(document, "workflow", source)
    functions: dict[tuple[str, str], dict[str, Any]] = {}
    for r, region in enumerate(document["regions"]):
        stages = sorted(f["stage"] for f in region["functions"])
        if stages != list(range(len(stages))):
            raise SchemaError(f"{source}: key regions/{r}/functions: stages {stages}; expected 0..{len(stages) - 1}")
        for f, function in enumerate(region["functions"]):
            if (region["name"], function["name"]) in functions:
                raise SchemaError(f"{source}: key regions/{r}/functions/{f}/name: {function['name']!r} repeats")
            functions[(region["name"], function["name"])] = function
    ids = [step["id"] for step in document["steps"]]
    graph: nx.DiGraph = nx.DiGraph()
    for i, step in enumerate(document["steps"]):
        if ids.count(step["id"]) > 1:
            raise SchemaError(f"{source}: key steps/{i}/id: {step['id']!r} repeats")
        function = functions.get((step["region"], step["function"]))
        if function is None:
            raise SchemaError(
                f"{source}: key steps/{i}/function: no function {step['function']!r} in region {step['region']!r}"
            )
        if step["replicas"] != function["replicas"]:
            raise SchemaError(
                f"{source}: key steps/{i}/replicas: {step['replicas']}, but function {step['function']!r} "
                f"has {function['replicas']}"
            )
        graph.add_node(step["id"])
        for d, dependency in enumerate(step["depends_on"]):
            if dependency not in ids:
                raise SchemaError(f"{source}: key steps/{i}/depends_on/{d}: no step {dependency!r}")
            graph.add_edge(dependency, step["id"])
    if not nx.is_directed_acyclic_graph(graph):
        cycle = " -> ".join(edge[0] for edge in nx.find_cycle(graph))
        raise SchemaError(f"{source}: key steps: the dependencies form a cycle ({cycle})")


def workflow_text(workflow: Workflow, source: str = "workflow.yaml") -> str:
    """workflow.yaml's bytes, checked."""
    document = workflow.to_json()
    check_workflow(document, source)
    return dump_yaml(document)


def save_workflow(workflow: Workflow, path: Path) -> None:
    path.write_text(workflow_text(workflow, str(path)))


def load_workflow(path: Path) -> Workflow:
    try:
        text = path.read_text()
    except UnicodeDecodeError as exc:
        raise SchemaError(f"{path}: not text: {exc}") from exc
    document = read_yaml(text, str(path))
    check_workflow(document, str(path))
    return Workflow.from_json(document)


def plan_text(plan: TrainingPlan, source: str = "plan.json") -> str:
    """plan.json's bytes, checked against its schema."""
    document = plan.to_json()
    validate(document, "plan", source)
    return dumps(document)


def save_plan(plan: TrainingPlan, path: Path) -> None:
    path.write_text(plan_text(plan, str(path)))


def load_plan(path: Path) -> TrainingPlan:
    try:
        document = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise SchemaError(f"{path}: not JSON: {exc}") from exc
    validate(document, "plan", str(path))
    return TrainingPlan.from_json(document)
