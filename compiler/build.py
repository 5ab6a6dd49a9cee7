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
from cloudless.compiler.lower import Lowered
from cloudless.compiler.plan import PlanOptions, PlanResult, plan_ir
from cloudless.compiler.simulate import Timeline
from cloudless.ir.blocks import BlockChain
from cloudless.ir.files import plan_text, workflow_text
from cloudless.ir.graph import OpGraph, dumps


def build_files(
    graph: OpGraph,
    chain: BlockChain,
    planned: PlanResult | None,
    plan_options: PlanOptions | None,
    timeline: Timeline | None,
    lowered: Lowered | None,
    targets: frozenset[str] = TARGETS,
) -> dict[str, bytes]:
    """Every file of the build, by path relative to the build folder."""
    files = {
        "ir/graph.json": dumps(graph.to_json()).encode(),
        "ir/blocks.json": dumps(chain.to_json()).encode(),
    }
    if planned is None or plan_options is None or timeline is None or lowered is None:
        return files
    plan = plan_ir(planned, chain, plan_options, timeline)
    files["plan.json"] = plan_text(plan).encode()
    workflow = lowered.workflow
    files.update(package_files(lowered))
    for region in workflow.regions:
        for path, text in render_region(workflow, region.name, set(targets)).items():
            files[path] = text.encode()
    if "sam" in targets:
        files["samconfig.toml"] = render_samconfig(workflow).encode()
    files.update(render_report(plan, timeline, workflow))
    return dict(sorted(files.items()))


def package_files(lowered: Lowered) -> dict[str, bytes]:
    """workflow.yaml and every function package: what `cloudless-run` needs of a build."""
    workflow = lowered.workflow
    files = {"workflow.yaml": workflow_text(workflow).encode()}
    for region in workflow.regions:
        for function, stage in zip(region.functions, lowered.stages, strict=True):
            files.update(
                render_function_package(
                    workflow,
                    region.name,
                    function,
                    stage_source=stage.source,
                    weights=stage.state,
                    loss_source=lowered.loss_source,
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
