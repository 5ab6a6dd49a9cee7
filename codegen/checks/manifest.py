"""workflow.yaml, what the controller and the workers run: its schema and DAG, and its agreement with
itself (batch sizes, stages tiling the block chain, each stage's inputs, step replicas, the inter-region
settings, the optimizer)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from ...ir.files import check_workflow
from ...ir.schema import SchemaError
from ...ir.workflow import Workflow
from .base import (
    BuildCheckError,
    BuildContext,
    fail,
    function_key_of,
    load_yaml,
    lookup,
    schema_check,
)


def check_manifest(build: Path, context: BuildContext | None) -> tuple[dict[str, Any], Workflow]:
    """workflow.yaml's document and workflow, once it passes its schema and the DAG check."""
    path = build / "workflow.yaml"
    if not path.exists():
        fail("workflow.yaml", "(file)", "missing")
    document = load_yaml(build, path)
    schema_check(document, "workflow", "workflow.yaml")
    _check_step_replicas(document, context)
    try:
        check_workflow(document, "workflow.yaml")
    except BuildCheckError:
        raise
    except SchemaError as exc:
        raise BuildCheckError(str(exc)) from exc
    return document, Workflow.from_json(document)


def _check_step_replicas(document: dict[str, Any], context: BuildContext | None) -> None:
    """Each step has its function's replicas (before check_workflow, to name the edited side)."""
    functions = {
        (region["name"], function["name"]): (f"regions/{r}/functions/{f}/replicas", function["replicas"])
        for r, region in enumerate(document["regions"])
        for f, function in enumerate(region["functions"])
    }
    for i, step in enumerate(document["steps"]):
        found = functions.get((step["region"], step["function"]))
        if found is None or found[1] == step["replicas"]:
            continue
        step_key, (function_key, replicas) = f"steps/{i}/replicas", found
        if context is not None and context.blame([step_key, function_key]) == function_key:
            fail(
                "workflow.yaml",
                function_key,
                f"{replicas}, but its steps (steps/{i}) have {step['replicas']}{context.was(function_key, replicas)}",
            )
        note = context.was(step_key, step["replicas"]) if context is not None else ""
        fail(
            "workflow.yaml",
            step_key,
            f"{step['replicas']}, but function {step['function']!r} has {replicas} ({function_key}){note}",
        )


def check_run(context: BuildContext, document: dict[str, Any], workflow: Workflow) -> None:
    """What the workers and the controller take from workflow.yaml agrees with itself."""
    file = "workflow.yaml"
    run = workflow.run
    if run.micro_batch * run.micro_batches != run.global_batch:
        key = context.blame(["run/micro_batch", "run/micro_batches", "run/global_batch"])
        fail(
            file,
            key,
            f"micro_batch {run.micro_batch} x micro_batches {run.micro_batches} = "
            f"{run.micro_batch * run.micro_batches}, but global_batch is {run.global_batch}: every iteration's "
            f"global_batch samples are cut into micro_batches of micro_batch{context.was(key, lookup(document, key))}",
        )
    blocks = _block_count(context.root)
    partition = [f.blocks for f in workflow.regions[0].functions]
    for r, region in enumerate(workflow.regions):
        functions = region.functions  # in stage order
        for function in functions:
            key = function_key_of(document, r, function.name)
            if function.package != f"regions/{region.name}/functions/{function.name}":
                fail(
                    file,
                    f"{key}/package",
                    f"{function.package!r}; expected 'regions/{region.name}/functions/{function.name}'"
                    + context.was(f"{key}/package", function.package),
                )
            first, last = function.blocks
            if first > last:
                fail(file, f"{key}/blocks", f"{list(function.blocks)}: the first block is after the last")
            if function.stage == 0 and first != 0:
                fail(file, f"{key}/blocks", f"{list(function.blocks)}: stage 0 must start at block 0")
            if function.stage > 0:
                before = functions[function.stage - 1]
                if first != before.blocks[1] + 1:
                    before_key = function_key_of(document, r, before.name)
                    blamed = context.blame([f"{key}/blocks", f"{before_key}/blocks"])
                    fail(
                        file,
                        blamed,
                        f"stage {before.stage} has blocks {list(before.blocks)} and stage {function.stage} "
                        f"{list(function.blocks)}: the stages must tile the block chain, each from the block after "
                        f"the last of the one before{context.was(blamed, lookup(document, blamed))}",
                    )
        if blocks is not None and functions[-1].blocks[1] != blocks - 1:
            key = f"{function_key_of(document, r, functions[-1].name)}/blocks"
            fail(
                file,
                key,
                f"{list(functions[-1].blocks)}: the last stage must end at the chain's last block {blocks - 1} "
                f"(ir/blocks.json has {blocks}){context.was(key, lookup(document, key))}",
            )
        if [f.blocks for f in functions] != partition:
            key = f"regions/{r}/functions"
            fail(
                file,
                key,
                f"blocks {[list(b) for b in (f.blocks for f in functions)]}, but region "
                f"{workflow.regions[0].name!r} has {[list(b) for b in partition]}: every region runs the same "
                "generated stages",
            )
        _check_stage_inputs(context, document, workflow, r)
    _check_regions(context, document, workflow)
    _check_optimizer(context, document, workflow)


def _block_count(build: Path) -> int | None:
    """How many blocks ir/blocks.json has (None without a readable one)."""
    try:
        blocks = json.loads((build / "ir" / "blocks.json").read_text())["blocks"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return len(blocks) if isinstance(blocks, list) else None


def _check_stage_inputs(context: BuildContext, document: dict[str, Any], workflow: Workflow, r: int) -> None:
    """Stage 0 takes the data inputs, in order (the worker zips them with the stored data); each later
    stage takes tensors the one before it sends (it reads only that stage's activations)."""
    file = "workflow.yaml"
    functions = workflow.regions[r].functions
    first_key = f"{function_key_of(document, r, functions[0].name)}/inputs"
    if functions[0].inputs != workflow.data.inputs:
        key = context.blame([first_key, "data/inputs"])
        fail(
            file,
            key,
            f"stage 0 takes {list(functions[0].inputs)}, but data/inputs is {list(workflow.data.inputs)}: the "
            f"first stage takes the data inputs in order{context.was(key, lookup(document, key))}",
        )
    for before, function in zip(functions, functions[1:], strict=False):
        missing = [name for name in function.inputs if name not in before.outputs]
        if missing:
            key = f"{function_key_of(document, r, function.name)}/inputs"
            before_key = f"{function_key_of(document, r, before.name)}/outputs"
            blamed = context.blame([key, before_key])
            fail(
                file,
                blamed,
                f"stage {function.stage} takes {missing}, which stage {before.stage} does not send (its outputs "
                f"are {list(before.outputs)}){context.was(blamed, lookup(document, blamed))}",
            )


def _check_regions(context: BuildContext, document: dict[str, Any], workflow: Workflow) -> None:
    """Several regions: what the controller and the workers' inter-region sync need."""
    file = "workflow.yaml"
    sync = workflow.sync
    names = [region.name for region in workflow.regions]
    for r, region in enumerate(workflow.regions):
        counted = sum(source.count for source in region.data_sources)
        if region.data_sources and region.samples is not None and region.samples != counted:
            counts = [f"regions/{r}/data_sources/{k}/count" for k in range(len(region.data_sources))]
            key = context.blame([f"regions/{r}/samples", *counts])
            if key in counts:
                count = region.data_sources[counts.index(key)].count
                what = f"{count}, but the region's samples are {region.samples} (its data_sources hold {counted})"
            else:
                what = f"{region.samples}, but its data_sources hold {counted}"
            fail(file, key, what + context.was(key, lookup(document, key)))
    if len(names) == 1:
        return
    if sync.inter_region is None:
        fail(file, "sync/inter_region", f"null, but {len(names)} regions train: their models must meet")
    if sync.rounds is None:
        fail(file, "sync/rounds", "missing: the controller runs every region for the planned rounds")
    if sync.inter_region == "asgd-ga" and sync.server not in names:
        fail(file, "sync/server", f"{sync.server!r} is not a region of workflow.yaml {names}: ASGD-GA's server")
    for r, region in enumerate(workflow.regions):
        if region.iterations is None:
            fail(file, f"regions/{r}/iterations", "missing: several regions run their planned iterations")
        if sync.inter_region == "sync" and region.iterations != workflow.run.iterations:
            key = context.blame([f"regions/{r}/iterations", "run/iterations"])
            fail(
                file,
                key,
                f"region {region.name!r}: iterations {region.iterations}, but run/iterations {workflow.run.iterations}:"
                " under sync every region runs every iteration" + context.was(key, lookup(document, key)),
            )
        if sync.inter_region == "sync" and sync.rounds != region.iterations:
            key = context.blame(["sync/rounds", f"regions/{r}/iterations"])
            fail(
                file,
                key,
                f"sync/rounds {sync.rounds}, but region {region.name!r} runs {region.iterations} iterations: under "
                "sync the regions meet every iteration" + context.was(key, lookup(document, key)),
            )
        if not 1 <= sync.rounds <= region.iterations:
            key = context.blame(["sync/rounds", f"regions/{r}/iterations"])
            fail(
                file,
                key,
                f"region {region.name!r}: {sync.rounds} rounds over {region.iterations} iterations; every round holds "
                "at least one iteration (round_ends)" + context.was(key, lookup(document, key)),
            )
        if sync.inter_region == "model-average" and region.weight is None:
            fail(file, f"regions/{r}/weight", "missing: model averaging weighs each region's model")
    if sync.inter_region == "model-average":
        total = sum(region.weight or 0.0 for region in workflow.regions)
        if not math.isclose(total, 1.0, abs_tol=1e-6):
            key = context.blame([f"regions/{r}/weight" for r in range(len(names))])
            fail(
                file,
                key,
                f"the regions' weights add up to {total:g}, not 1: the average would scale the model"
                + context.was(key, lookup(document, key)),
            )


def _check_optimizer(context: BuildContext, document: dict[str, Any], workflow: Workflow) -> None:
    """Every worker builds `torch.optim.<class>(parameters, **options)`: build one on a dummy parameter."""
    import torch

    spec = workflow.optimizer
    optimizer = getattr(torch.optim, spec.class_name, None)
    if not (isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer)):
        fail(
            "workflow.yaml",
            "optimizer/class",
            f"{spec.class_name!r} is not a torch.optim optimizer" + context.was("optimizer/class", spec.class_name),
        )
    try:
        optimizer([torch.nn.Parameter(torch.zeros(1))], **spec.options)
    except (TypeError, ValueError, RuntimeError) as exc:
        fail("workflow.yaml", "optimizer/options", f"torch.optim.{spec.class_name} refuses them: {exc}")

    def check_rates(key: str, rates: tuple[float, ...] | None) -> None:
        if rates is not None and len(rates) != workflow.run.iterations:
            fail(
                "workflow.yaml",
                key,
                f"{len(rates)} rates; expected one per iteration of run/iterations ({workflow.run.iterations})",
            )

    check_rates("optimizer/learning_rates", spec.learning_rates)
    seen: dict[str, int] = {}
    for index, group in enumerate(spec.groups):
        key = f"optimizer/groups/{index}"
        try:
            optimizer([{"params": [torch.nn.Parameter(torch.zeros(1))], **group.options}], **spec.options)
        except (TypeError, ValueError, RuntimeError) as exc:
            fail("workflow.yaml", f"{key}/options", f"torch.optim.{spec.class_name} refuses them: {exc}")
        for name in group.parameters:
            if name in seen:
                fail("workflow.yaml", f"{key}/parameters", f"{name!r} is also in group {seen[name]}")
            seen[name] = index
        check_rates(f"{key}/learning_rates", group.learning_rates)
