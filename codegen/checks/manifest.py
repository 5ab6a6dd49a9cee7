"""workflow.yaml, what the controller and the workers run: its schema and DAG, and its agreement with
itself (batch sizes, stages tiling the block chain, each stage's inputs, step replicas, the inter-region
settings, the optimizer).

The rules of that agreement are the workflow's own (cloudless.ir.workflow_rules); this module reads the
file, checks the last stage against ir/blocks.json, and of the keys a rule finds disagreeing names the one
edited after the compile."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ...ir.files import check_workflow
from ...ir.schema import SchemaError
from ...ir.workflow import Workflow
from ...ir.workflow_rules import (
    WorkflowProblem,
    batch_problem,
    function_key,
    optimizer_problem,
    partition_problem,
    samples_problem,
    stage_inputs_problem,
    stage_problem,
    step_replicas_problem,
    sync_problem,
)
from .base import (
    BuildCheckError,
    BuildContext,
    fail,
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
    # before check_workflow, which would name the step alone: either side may be the edited one
    _report(context, document, step_replicas_problem(document))
    try:
        check_workflow(document, "workflow.yaml")
    except BuildCheckError:
        raise
    except SchemaError as exc:
        raise BuildCheckError(str(exc)) from exc
    return document, Workflow.from_json(document)


def _report(context: BuildContext | None, document: dict[str, Any], problem: WorkflowProblem | None) -> None:
    """Fail with a workflow rule's problem: of the keys it could name, the one not as compiled (the first
    when that cannot be told), and what that value was compiled as."""
    if problem is None:
        return
    key = context.blame(problem.keys) if context is not None and problem.others else problem.key
    note = context.was(key, lookup(document, key)) if context is not None and problem.note_compiled else ""
    fail("workflow.yaml", key, problem.message_at(key) + note)


def check_run(context: BuildContext, document: dict[str, Any], workflow: Workflow) -> None:
    """What the workers and the controller take from workflow.yaml agrees with itself, and its stages end at
    ir/blocks.json's last block."""
    _report(context, document, batch_problem(workflow))
    blocks = _block_count(context.root)
    for r, region in enumerate(workflow.regions):
        _report(context, document, stage_problem(workflow, document, r))
        last = region.functions[-1]  # in stage order
        if blocks is not None and last.blocks[1] != blocks - 1:
            key = f"{function_key(document, r, last.name)}/blocks"
            fail(
                "workflow.yaml",
                key,
                f"{list(last.blocks)}: the last stage must end at the chain's last block {blocks - 1} "
                f"(ir/blocks.json has {blocks}){context.was(key, lookup(document, key))}",
            )
        _report(context, document, partition_problem(workflow, r))
        _report(context, document, stage_inputs_problem(workflow, document, r))
    _report(context, document, samples_problem(workflow))
    _report(context, document, sync_problem(workflow))
    _report(context, document, optimizer_problem(workflow))


def _block_count(build: Path) -> int | None:
    """How many blocks ir/blocks.json has (None without a readable one)."""
    try:
        blocks = json.loads((build / "ir" / "blocks.json").read_text())["blocks"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return len(blocks) if isinstance(blocks, list) else None
