"""What a workflow must agree with in itself, beyond its schema and DAG (`cloudless.ir.files.check_workflow`):
batch sizes, the stages tiling the block chain in every region alike, each stage's inputs, step replicas,
the inter-region settings, the optimizer.

Each rule takes the typed `Workflow` (and its document where the problem names a key of it: the functions'
keys are by their order in the document, not by stage) and returns the first `WorkflowProblem`, or None.
The rules know nothing of a build folder: comparing the workflow with the build's other files, and telling
which of two disagreeing values was edited, is `cloudless.codegen.checks.manifest`'s. Not vendored into
function packages.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .workflow import Workflow


@dataclass(frozen=True)
class WorkflowProblem:
    """A rule the workflow breaks: at the key path `key` of its document (`regions/0/functions/1/inputs`),
    `message`.

    A rule that finds values disagreeing with each other names the first; `others` holds the keys of the
    others, each with what to say when it is the one named (one of them may be the value to fix)."""

    key: str
    message: str
    #: (key, message) of the other values the rule could blame instead, in order
    others: tuple[tuple[str, str], ...] = ()
    #: the named value is what breaks the rule: a check that knows the document as compiled may add what
    #: that value was compiled as
    note_compiled: bool = False

    @property
    def keys(self) -> list[str]:
        """Every key the rule could name, `key` first."""
        return [self.key, *(key for key, _ in self.others)]

    def message_at(self, key: str) -> str:
        """The message when `key` (one of `keys`) is the one named."""
        return self.message if key == self.key else dict(self.others)[key]

    def __str__(self) -> str:
        return f"key {self.key}: {self.message}"


def _disagree(keys: Sequence[str], message: str) -> WorkflowProblem:
    """Values at `keys` that disagree with each other, with one message whichever is named."""
    return WorkflowProblem(keys[0], message, tuple((key, message) for key in keys[1:]), note_compiled=True)


def function_key(document: Mapping[str, Any], region: int, name: str) -> str:
    """The document's key of a region's function (`Workflow.from_json` sorts them by stage)."""
    for index, function in enumerate(document["regions"][region]["functions"]):
        if function["name"] == name:
            return f"regions/{region}/functions/{index}"
    raise KeyError(name)


def step_replicas_problem(document: Mapping[str, Any]) -> WorkflowProblem | None:
    """A step with other replicas than its function. On the document, before `check_workflow` (which refuses
    the step alone): the function's replicas may be the value to fix."""
    functions = {
        (region["name"], function["name"]): (f"regions/{r}/functions/{f}/replicas", function["replicas"])
        for r, region in enumerate(document["regions"])
        for f, function in enumerate(region["functions"])
    }
    for i, step in enumerate(document["steps"]):
        found = functions.get((step["region"], step["function"]))
        if found is None or found[1] == step["replicas"]:
            continue
        function_replicas_key, replicas = found
        return WorkflowProblem(
            f"steps/{i}/replicas",
            f"{step['replicas']}, but function {step['function']!r} has {replicas} ({function_replicas_key})",
            ((function_replicas_key, f"{replicas}, but its steps (steps/{i}) have {step['replicas']}"),),
            note_compiled=True,
        )
    return None


def batch_problem(workflow: Workflow) -> WorkflowProblem | None:
    """Every iteration's global_batch samples are cut into micro_batches of micro_batch."""
    run = workflow.run
    if run.micro_batch * run.micro_batches == run.global_batch:
        return None
    return _disagree(
        ["run/micro_batch", "run/micro_batches", "run/global_batch"],
        f"micro_batch {run.micro_batch} x micro_batches {run.micro_batches} = "
        f"{run.micro_batch * run.micro_batches}, but global_batch is {run.global_batch}: every iteration's "
        "global_batch samples are cut into micro_batches of micro_batch",
    )


def stage_problem(workflow: Workflow, document: Mapping[str, Any], r: int) -> WorkflowProblem | None:
    """Region `r`'s functions: each in its package folder, its blocks in order, stage 0 from block 0 and each
    later stage from the block after the last of the one before."""
    region = workflow.regions[r]
    functions = region.functions  # in stage order
    for function in functions:
        key = function_key(document, r, function.name)
        if function.package != f"regions/{region.name}/functions/{function.name}":
            return WorkflowProblem(
                f"{key}/package",
                f"{function.package!r}; expected 'regions/{region.name}/functions/{function.name}'",
                note_compiled=True,
            )
        first, last = function.blocks
        if first > last:
            return WorkflowProblem(f"{key}/blocks", f"{list(function.blocks)}: the first block is after the last")
        if function.stage == 0 and first != 0:
            return WorkflowProblem(f"{key}/blocks", f"{list(function.blocks)}: stage 0 must start at block 0")
        if function.stage > 0:
            before = functions[function.stage - 1]
            if first != before.blocks[1] + 1:
                return _disagree(
                    [f"{key}/blocks", f"{function_key(document, r, before.name)}/blocks"],
                    f"stage {before.stage} has blocks {list(before.blocks)} and stage {function.stage} "
                    f"{list(function.blocks)}: the stages must tile the block chain, each from the block after "
                    "the last of the one before",
                )
    return None


def partition_problem(workflow: Workflow, r: int) -> WorkflowProblem | None:
    """Region `r`'s stages have the blocks of the first region's: every region runs the same stages."""
    blocks = [list(f.blocks) for f in workflow.regions[r].functions]
    partition = [list(f.blocks) for f in workflow.regions[0].functions]
    if blocks == partition:
        return None
    return WorkflowProblem(
        f"regions/{r}/functions",
        f"blocks {blocks}, but region {workflow.regions[0].name!r} has {partition}: every region runs the same "
        "generated stages",
    )


def stage_inputs_problem(workflow: Workflow, document: Mapping[str, Any], r: int) -> WorkflowProblem | None:
    """Stage 0 of region `r` takes the data inputs, in order (the worker zips them with the stored data); each
    later stage takes tensors the one before it sends (it reads only that stage's activations)."""
    functions = workflow.regions[r].functions
    if functions[0].inputs != workflow.data.inputs:
        return _disagree(
            [f"{function_key(document, r, functions[0].name)}/inputs", "data/inputs"],
            f"stage 0 takes {list(functions[0].inputs)}, but data/inputs is {list(workflow.data.inputs)}: the "
            "first stage takes the data inputs in order",
        )
    for before, function in zip(functions, functions[1:], strict=False):
        missing = [name for name in function.inputs if name not in before.outputs]
        if missing:
            return _disagree(
                [
                    f"{function_key(document, r, function.name)}/inputs",
                    f"{function_key(document, r, before.name)}/outputs",
                ],
                f"stage {function.stage} takes {missing}, which stage {before.stage} does not send (its outputs "
                f"are {list(before.outputs)})",
            )
    return None


def samples_problem(workflow: Workflow) -> WorkflowProblem | None:
    """A region with data sources holds as many samples as they count."""
    for r, region in enumerate(workflow.regions):
        counted = sum(source.count for source in region.data_sources)
        if region.data_sources and region.samples is not None and region.samples != counted:
            counts = tuple(
                (
                    f"regions/{r}/data_sources/{k}/count",
                    f"{source.count}, but the region's samples are {region.samples} (its data_sources hold {counted})",
                )
                for k, source in enumerate(region.data_sources)
            )
            return WorkflowProblem(
                f"regions/{r}/samples",
                f"{region.samples}, but its data_sources hold {counted}",
                counts,
                note_compiled=True,
            )
    return None


def sync_problem(workflow: Workflow) -> WorkflowProblem | None:
    """Several regions: what the controller and the workers' inter-region sync need (a strategy, the
    rounds, ASGD-GA's server, each region's iterations and model averaging's weights)."""
    sync = workflow.sync
    names = [region.name for region in workflow.regions]
    if len(names) == 1:
        return None
    if sync.inter_region is None:
        return WorkflowProblem("sync/inter_region", f"null, but {len(names)} regions train: their models must meet")
    if sync.rounds is None:
        return WorkflowProblem("sync/rounds", "missing: the controller runs every region for the planned rounds")
    if sync.inter_region == "asgd-ga" and sync.server not in names:
        return WorkflowProblem(
            "sync/server", f"{sync.server!r} is not a region of workflow.yaml {names}: ASGD-GA's server"
        )
    for r, region in enumerate(workflow.regions):
        iterations, name = region.iterations, region.name
        if iterations is None:
            return WorkflowProblem(f"regions/{r}/iterations", "missing: several regions run their planned iterations")
        if sync.inter_region == "sync" and iterations != workflow.run.iterations:
            return _disagree(
                [f"regions/{r}/iterations", "run/iterations"],
                f"region {name!r}: iterations {iterations}, but run/iterations {workflow.run.iterations}:"
                " under sync every region runs every iteration",
            )
        if sync.inter_region == "sync" and sync.rounds != iterations:
            return _disagree(
                ["sync/rounds", f"regions/{r}/iterations"],
                f"sync/rounds {sync.rounds}, but region {name!r} runs {iterations} iterations: under "
                "sync the regions meet every iteration",
            )
        if not 1 <= sync.rounds <= iterations:
            return _disagree(
                ["sync/rounds", f"regions/{r}/iterations"],
                f"region {name!r}: {sync.rounds} rounds over {iterations} iterations; every round holds "
                "at least one iteration (round_ends)",
            )
        if sync.inter_region == "model-average" and region.weight is None:
            return WorkflowProblem(f"regions/{r}/weight", "missing: model averaging weighs each region's model")
    if sync.inter_region == "model-average":
        total = sum(region.weight or 0.0 for region in workflow.regions)
        if not math.isclose(total, 1.0, abs_tol=1e-6):
            return _disagree(
                [f"regions/{r}/weight" for r in range(len(names))],
                f"the regions' weights add up to {total:g}, not 1: the average would scale the model",
            )
    return None


def optimizer_problem(workflow: Workflow) -> WorkflowProblem | None:
    """Every worker builds `torch.optim.<class>(parameters, **options)` (with each parameter group's options):
    one is built on a dummy parameter. A learning-rate schedule has one rate per iteration of the run, and no
    parameter is in two groups."""
    import torch  # only here: the other rules need no torch

    spec = workflow.optimizer
    where = f"{spec.module or 'torch.optim'}.{spec.class_name}"
    try:
        optimizer: Any = spec.optimizer_class()
    except (ImportError, AttributeError):
        if spec.module is not None:
            # the model file's own module, or one only the functions' packages hold, is not importable here:
            # the functions import it (what a class outside torch.optim takes is the compiler's probe's)
            return _rates_and_groups_problem(workflow, None, where)
        optimizer = None
    if not (isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer)):
        what = "a torch.optim optimizer" if spec.module is None else "a torch.optim.Optimizer subclass"
        return WorkflowProblem("optimizer/class", f"{spec.class_name!r} is not {what}", note_compiled=True)
    try:
        optimizer([torch.nn.Parameter(torch.zeros(1))], **spec.options)
    except (TypeError, ValueError, RuntimeError) as exc:
        return WorkflowProblem("optimizer/options", f"{where} refuses them: {exc}")
    return _rates_and_groups_problem(workflow, optimizer, where)


def _rates_and_groups_problem(workflow: Workflow, optimizer: Any, where: str) -> WorkflowProblem | None:
    """The schedule's and the parameter groups' rules; each group's options tried on `optimizer` (None: the
    class is not importable here)."""
    import torch

    spec = workflow.optimizer
    problem = _rates_problem(workflow, "optimizer/learning_rates", spec.learning_rates)
    if problem is not None:
        return problem
    seen: dict[str, int] = {}
    for index, group in enumerate(spec.groups):
        key = f"optimizer/groups/{index}"
        try:
            if optimizer is not None:
                optimizer([{"params": [torch.nn.Parameter(torch.zeros(1))], **group.options}], **spec.options)
        except (TypeError, ValueError, RuntimeError) as exc:
            return WorkflowProblem(f"{key}/options", f"{where} refuses them: {exc}")
        for name in group.parameters:
            if name in seen:
                return WorkflowProblem(f"{key}/parameters", f"{name!r} is also in group {seen[name]}")
            seen[name] = index
        problem = _rates_problem(workflow, f"{key}/learning_rates", group.learning_rates)
        if problem is not None:
            return problem
    return None


def _rates_problem(workflow: Workflow, key: str, rates: tuple[float, ...] | None) -> WorkflowProblem | None:
    if rates is None or len(rates) == workflow.run.iterations:
        return None
    return WorkflowProblem(
        key, f"{len(rates)} rates; expected one per iteration of run/iterations ({workflow.run.iterations})"
    )
