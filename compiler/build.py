"""The build folder: every file a compile writes, assembled in memory, checked, then put in place.

Assembling the whole tree as {path: bytes} first makes the output easy to compare (two compiles,
golden files) and lets the validators run on a staging folder: the build is renamed into place only
when it passes them, so a failed compile leaves the previous build as it was. Every generated stage
is loaded before its package is written (`check_stage_loads`): one that does not load is a compile
error, never a function's failure at run time.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from ..codegen.package import render_function_package, torch_release
from ..codegen.platforms import TARGETS, render_region, render_samconfig
from ..codegen.report import render_report
from ..ir.blocks import BlockChain
from ..ir.catalog import load_catalog
from ..ir.files import BUILD_MARKER, build_manifest, plan_text, workflow_text
from ..ir.folders import FolderError, check_output_folder, run_lock, run_outputs, shortened
from ..ir.graph import OpGraph, dumps
from ..ir.plan import TrainingPlan
from .frontend.verify import check_library_ops_resolve, check_stage_loads
from .lower import Lowered
from .planner.plan import PlanOptions
from .planner.simulate import Timeline


def build_files(
    graph: OpGraph,
    chain: BlockChain,
    plan: TrainingPlan | None,
    plan_options: PlanOptions | None,
    timeline: Timeline | None,
    lowered: Lowered | None,
    targets: frozenset[str] = TARGETS,
) -> dict[str, bytes]:
    """Every file of the build, by path relative to the build folder, the marker with their digests
    included: what the passes before made, serialised (nothing here plans or simulates)."""
    files = {
        "ir/graph.json": dumps(graph.to_json()).encode(),
        "ir/blocks.json": dumps(chain.to_json()).encode(),
    }
    if plan is not None and plan_options is not None and timeline is not None and lowered is not None:
        files.update(_planned_files(plan, timeline, lowered, targets, graph, plan_options))
    elif plan is not None:  # planned only (--plan-only): no stages, so no packages to describe
        files["plan.json"] = plan_text(plan).encode()
    return dict(sorted({**files, BUILD_MARKER: build_manifest(files)}.items()))


def _planned_files(
    plan: TrainingPlan,
    timeline: Timeline,
    lowered: Lowered,
    targets: frozenset[str],
    graph: OpGraph,
    plan_options: PlanOptions,
) -> dict[str, bytes]:
    """plan.json, the packages, each region's deployment files, samconfig.toml and the report."""
    files = {"plan.json": plan_text(plan).encode()}
    workflow = lowered.workflow
    files.update(package_files(lowered, graph))
    catalog = load_catalog(plan_options.catalog)
    predicted = _predicted_iteration_s(plan)
    for region in workflow.regions:
        # SAM deploys to AWS only: another provider's region gets the OpenFaaS files alone
        wanted = set(targets) if region.provider == "aws" else set(targets) - {"sam"}
        # images: --registry, else the region's registry in the catalog; tagged by their packages' content
        registry = plan_options.registry or catalog.region(region.name).registry
        rendered = render_region(
            workflow, region.name, wanted, registry=registry, packages=files, iteration_s=predicted.get(region.name)
        )
        for path, text in rendered.items():
            files[path] = text.encode()
    if "sam" in targets and any(region.provider == "aws" for region in workflow.regions):
        files["samconfig.toml"] = render_samconfig(workflow).encode()
    files.update(render_report(plan, timeline, workflow, files))
    return files


def _predicted_iteration_s(plan: TrainingPlan) -> dict[str, float]:
    """Each training region's predicted seconds per iteration (how many iterations a deployed invocation runs)."""
    if plan.regions is None:
        return {plan.region: plan.predicted.iteration_s}
    return {site.name: site.iteration_s for site in plan.regions.sites if site.iteration_s is not None}


def package_files(lowered: Lowered, graph: OpGraph | None = None) -> dict[str, bytes]:
    """workflow.yaml and every function package: what `cloudless-run` needs of a build. The stages
    and the loss module are loaded first (with `graph`, the stages' forward also runs on meta tensors
    of their inputs' shapes)."""
    check_modules_load(lowered, graph)
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
                    user_sources=dict(lowered.user_sources),
                    user_imports=lowered.user_imports,
                )
            )
    return files


def check_modules_load(lowered: Lowered, graph: OpGraph | None = None) -> None:
    """Load every generated stage, and the loss module, as a function would (on the meta device):
    CompileError naming the stage if one does not."""
    count = len(lowered.stages)
    for stage in lowered.stages:
        inputs = _meta_inputs(graph, stage.inputs) if graph is not None else None
        label = f"stage {stage.index} of {count} (blocks {stage.first_block}-{stage.last_block})"
        check_stage_loads(stage.source, stage.state, label, inputs)
    check_stage_loads(lowered.loss_source, {}, "the loss module")
    check_library_ops_resolve(
        [(f"stage {s.index} of {count}", s.source) for s in lowered.stages] + [("the loss module", lowered.loss_source)]
    )


def _meta_inputs(graph: OpGraph, names: Sequence[str]) -> list[Any] | None:
    """Meta tensors of the stage inputs' shapes and dtypes (None if one is not a tensor or tensors)."""
    inputs: list[Any] = []
    by_name = {node.name: node for node in graph.nodes}
    for name in names:
        node = by_name.get(name)
        if node is None or node.value not in ("tensor", "tensors"):
            return None
        tensors = [torch.empty(m.shape, dtype=getattr(torch, m.dtype), device="meta") for m in node.outputs]
        inputs.append(tensors[0] if node.value == "tensor" else tuple(tensors))
    return inputs


def write_build(
    files: dict[str, bytes],
    output: Path,
    check: Callable[[Path], None] | None = None,
    protected: Sequence[Path] = (),
) -> None:
    """Write `files` into a temporary sibling of `output`, run `check` on it, then swap it into place.

    `output` must pass `check_output_folder` (checked again here, the compile having taken a while):
    what it replaces is nothing or an earlier build. The earlier build's run outputs (`run/`, any
    `--out` inside it) are the user's results, not the compiler's: they move into the new build before
    the swap, each under its run lock so that no run starts writing there meanwhile (FolderError if one
    is). A failure puts them and the previous build back.
    """
    check_output_folder(output, "build", protected=protected)
    resolved = output.resolve()
    try:
        resolved.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{resolved.name}.", dir=resolved.parent))
    except OSError as exc:  # a read-only mount, a folder of another user's
        raise FolderError(f"-o {shortened(str(output))}: cannot be written: {exc.strerror or exc}") from None
    moved: list[str] = []  # run outputs now in staging, to move back if the swap fails
    try:
        try:
            for path, data in files.items():
                target = staging / path
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(data)
        except OSError as exc:  # a full disk: the half-written staging folder goes (finally)
            raise FolderError(
                f"-o {shortened(str(output))}: the build could not be written: {exc.strerror or exc}"
            ) from None
        if check is not None:
            check(staging)
        if not resolved.exists():
            os.replace(staging, resolved)
            return
        runs = [run.name for run in run_outputs(resolved)]
        taken = {path.split("/")[0] for path in files}
        for name in runs:
            if name in taken:
                raise FolderError(
                    f"-o {output}: {output / name} holds a run's output where the new build writes its own "
                    "files; move it away"
                )
        with ExitStack() as locks:
            # the run folders end at the same paths, moved or not: each lock is removed where it was taken
            for name in runs:
                locks.enter_context(run_lock(output / name))
            _swap(staging, resolved, runs, moved)
    finally:
        # never delete a run output that could not be moved back: leave the staging folder to the user
        if staging.exists() and not moved:
            shutil.rmtree(staging)


def _swap(staging: Path, output: Path, runs: list[str], moved: list[str]) -> None:
    """Move the run outputs `runs` of the build `output` into `staging`, then `staging` in place of
    `output`; on a failure, put back the previous build and the runs (those still away stay in `moved`)."""
    retired = Path(tempfile.mkdtemp(prefix=f".{output.name}.old.", dir=output.parent))
    try:
        try:
            for name in runs:
                os.replace(output / name, staging / name)
                moved.append(name)
            os.replace(output, retired / output.name)
        except BaseException:
            _move_back(moved, staging, output)
            raise
        try:
            os.replace(staging, output)
        except BaseException:
            os.replace(retired / output.name, output)
            _move_back(moved, staging, output)
            raise
        moved.clear()
        shutil.rmtree(retired)
    finally:
        if retired.exists() and not any(retired.iterdir()):
            retired.rmdir()


def _move_back(moved: list[str], staging: Path, output: Path) -> None:
    """Return the run outputs moved into `staging` to the previous build `output`, emptying `moved`."""
    while moved:
        os.replace(staging / moved[-1], output / moved[-1])
        moved.pop()
