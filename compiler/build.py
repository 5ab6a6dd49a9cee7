"""The build folder: every file a compile writes, assembled in memory, checked, then put in place.

Assembling the whole tree as {path: bytes} first makes the output easy to compare (two compiles,
golden files) and lets the validators run on a staging folder: the build is renamed into place only
when it passes them, so a failed compile leaves the previous build as it was.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from cloudless.codegen.package import render_function_package, torch_release
from cloudless.codegen.platforms import TARGETS, render_region, render_samconfig
from cloudless.codegen.report import render_report
from cloudless.compiler.pipeline import FrontEndResult
from cloudless.compiler.plan import plan_document
from cloudless.compiler.simulate import simulate
from cloudless.ir.files import check_workflow, dump_yaml
from cloudless.ir.graph import dumps
from cloudless.ir.schema import validate


def build_files(result: FrontEndResult, targets: frozenset[str] = TARGETS) -> dict[str, bytes]:
    """Every file of the build, by path relative to the build folder."""
    files = {
        "ir/graph.json": dumps(result.graph.to_json()).encode(),
        "ir/blocks.json": dumps(result.chain.to_json()).encode(),
    }
    if result.plan is None or result.plan_options is None or result.workflow is None:
        return files
    plan = plan_document(result.plan, result.chain, result.plan_options)
    validate(plan, "plan", "plan.json")
    files["plan.json"] = dumps(plan).encode()
    workflow = result.workflow
    files.update(package_files(result))
    for region in workflow["regions"]:
        for path, text in render_region(workflow, region["name"], set(targets)).items():
            files[path] = text.encode()
    if "sam" in targets:
        files["samconfig.toml"] = render_samconfig(workflow).encode()
    timeline = simulate(result.plan.problem, result.plan.solution.plan)
    files.update(render_report(plan, timeline, workflow))
    return dict(sorted(files.items()))


def package_files(result: FrontEndResult) -> dict[str, bytes]:
    """workflow.yaml and every function package: what `cloudless-run` needs of a build."""
    workflow = result.workflow
    if workflow is None:
        raise ValueError("no workflow: lower the plan first (lower_training)")
    check_workflow(workflow)
    files = {"workflow.yaml": dump_yaml(workflow).encode()}
    for region in workflow["regions"]:
        for function, stage in zip(region["functions"], result.stages, strict=True):
            files.update(
                render_function_package(
                    workflow,
                    region["name"],
                    function,
                    stage_source=stage.source,
                    weights=stage.state,
                    loss_source=result.loss_source,
                    torch_version=torch_release(),
                )
            )
    return files


def write_build(files: dict[str, bytes], output: Path, check: Callable[[Path], None] | None = None) -> None:
    """Write `files` into a temporary sibling of `output`, run `check` on it, then swap it into place."""
    output = output.resolve()
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.", dir=output.parent))
    try:
        for path, data in files.items():
            target = staging / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
        if check is not None:
            check(staging)
        if output.exists():
            retired = Path(tempfile.mkdtemp(prefix=f".{output.name}.old.", dir=output.parent))
            os.replace(output, retired / output.name)
            os.replace(staging, output)
            shutil.rmtree(retired)
        else:
            os.replace(staging, output)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
