"""plan.json against workflow.yaml: the report and the platform files come from the plan, the run from
the workflow."""

from __future__ import annotations

import json
from typing import Any

from ...ir.plan import PlannedStage, TrainingPlan
from ...ir.workflow import Workflow
from ...ir.workflow_rules import function_key
from .base import EDITED, BuildContext, fail, schema_check, shorten


def check_plan(context: BuildContext, document: dict[str, Any], workflow: Workflow) -> None:
    """plan.json's stages, batch sizes and schedule are workflow.yaml's (the report and the platform
    files come from the plan, the run from the workflow). Without plan.json nothing to compare: the
    digests say whether it should be there."""
    file = "plan.json"
    path = context.root / file
    if not path.is_file():
        return
    try:
        plan_document = json.loads(path.read_text())
    except ValueError as exc:
        fail(file, "(top level)", f"not JSON: {exc}")
    schema_check(plan_document, "plan", file)
    try:
        plan = TrainingPlan.from_json(plan_document)
    except ValueError as exc:
        fail(file, "(top level)", str(exc))

    def agree(plan_key: str, plan_value: Any, workflow_key: str, workflow_value: Any) -> None:
        if plan_value == workflow_value:
            return
        if context.culprit(file, "workflow.yaml") == file:
            fail(
                file,
                plan_key,
                f"{shorten(plan_value)}, but workflow.yaml has {shorten(workflow_value)} at {workflow_key}"
                + context.note(file),
            )
        fail(
            "workflow.yaml",
            workflow_key,
            f"{shorten(workflow_value)}, but plan.json has {shorten(plan_value)} at {plan_key}{EDITED}",
        )

    run = workflow.run
    agree("model", plan.model, "model", workflow.model)
    agree("schedule", plan.schedule, "run/schedule", run.schedule)
    for key in ("global_batch", "micro_batch", "micro_batches"):
        agree(key, getattr(plan, key), f"run/{key}", getattr(run, key))
    planned: dict[str, tuple[str, tuple[PlannedStage, ...]]] = {}
    if plan.regions is None:
        planned[plan.region] = ("stages", plan.stages)
    else:
        for s, site in enumerate(plan.regions.sites):
            if site.trains:
                planned[site.name] = (f"regions/sites/{s}/stages", site.stages)
        if len(workflow.regions) > 1:
            agree("regions/sync", plan.regions.sync, "sync/inter_region", workflow.sync.inter_region)
            agree("regions/rounds", plan.regions.rounds, "sync/rounds", workflow.sync.rounds)
            if workflow.sync.inter_region == "asgd-ga":
                agree("regions/server", plan.regions.server, "sync/server", workflow.sync.server)
    agree(
        "regions/sites" if plan.regions is not None else "region",
        sorted(planned),
        "regions",
        sorted(region.name for region in workflow.regions),
    )
    for r, region in enumerate(workflow.regions):
        where, stages = planned[region.name]
        agree(where, len(stages), f"regions/{r}/functions", len(region.functions))
        for position, (stage, function) in enumerate(zip(stages, region.functions, strict=True)):
            key = function_key(document, r, function.name)
            here = f"{where}/{position}"
            agree(f"{here}/index", stage.index, f"{key}/stage", function.stage)
            agree(f"{here}/blocks", list(stage.blocks), f"{key}/blocks", list(function.blocks))
            agree(f"{here}/tier_mb", stage.tier_mb, f"{key}/memory_mb", function.memory_mb)
            agree(f"{here}/replicas", stage.replicas, f"{key}/replicas", function.replicas)
