"""Lower a plan into the workflow manifest (workflow.yaml) and the sources its functions run.

Per region, one function per pipeline stage (its replicas are instances of that function) and, per
stage, the steps of one iteration: `compute` (the stage's micro-batch schedule), `scatter-reduce`
among its replicas when it has more than one, `optimizer-step` (after every stage sharing a
parameter with it has its gradients), and `checkpoint` every `checkpoint_every` iterations. With several
regions, the inter-region sync step of the strategy (`SYNC_STEP_KIND`) after the optimizer step: every
iteration under `sync`, else at the ends of the region's rounds (`ir.workflow.round_ends`).

What the functions need of the user's model file is lowered too, so that no function imports it:
the optimizer as a torch.optim class and its options, the loss as generated torch-only source.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ..codegen.stage_source import StageHeader, render_stage_source
from ..ir import catalog
from ..ir.schedule import MAX_SYNC_PIECES, SYNC_PIECE_BYTES
from ..ir.workflow import (
    SYNC_STEP_KIND,
    DataSource,
    DataSpec,
    Function,
    InterRegionSync,
    OptimizerSpec,
    Region,
    RegionPrices,
    RunSettings,
    Schedule,
    Step,
    StepKind,
    StorageSpec,
    SyncSettings,
    WanLink,
    Workflow,
)
from .errors import CompileError
from .frontend.model_file import ModelFile, probe_learning_rates, probe_optimizer, probe_parameter_groups
from .frontend.trace import trace_model
from .planner.cost_model import Plan, checkpoint_interval


def default_staleness_bound(training_regions: int) -> int:
    """ASGD-GA's default staleness bound: a push whose base lags the global model by more than this many
    versions is rebased. One version per other training region: a push may lag the pushes of every other
    region's same round (regions running at different paces), but not a whole round more."""
    return max(0, training_regions - 1)


LOSS_MODULE = "loss"


@dataclass(frozen=True)
class StageCode:
    """A generated stage: its source, its slice of the weights, and what it takes and returns."""

    index: int
    first_block: int
    last_block: int
    source: str
    state: dict[str, torch.Tensor]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    #: names of the trainable tensors in `state`
    trainable: tuple[str, ...] = ()
    #: names of the frozen parameters in `state` (requires_grad=False in the model)
    frozen: tuple[str, ...] = ()
    #: a staged build: (name in `state`, the model's parameter name) of the parameters whose weights
    #: the run stages into storage (the package holds the stage's other tensors)
    staged: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Lowered:
    """A plan lowered to what the functions run: the stages' source and weights, the loss module
    (the last stage's), and the workflow."""

    stages: tuple[StageCode, ...]
    loss_source: str
    workflow: Workflow
    #: the model file and the modules beside it that it imports, by path relative to its folder
    user_sources: tuple[tuple[str, bytes], ...] = ()
    #: the third-party modules the functions import through them (libraries.third_party_imports)
    user_imports: tuple[str, ...] = ()


@dataclass(frozen=True)
class StageInterface:
    """What lowering needs of a generated stage: its index, what it takes and returns, which tensors."""

    index: int
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    parameters: tuple[str, ...]
    frozen: tuple[str, ...] = ()
    staged: tuple[tuple[str, str], ...] = ()


def slug(text: str, limit: int = 40) -> str:
    """A DNS-1035 label from any name: lowercase letters, digits and '-', starting with a letter."""
    label = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    if not label or not label[0].isalpha():
        label = "m-" + label
    return label[:limit].rstrip("-")


def describe_optimizer(model_file: ModelFile, iterations: int, model: nn.Module) -> OptimizerSpec:
    """The model file's optimizer as the workflow names it: a torch.optim class and its options,
    and its scheduler's learning rate at each of the run's `iterations`; with several parameter
    groups, each group's parameters (of `model`, by name), options and rates."""
    probe = probe_optimizer(model_file)
    groups = probe_parameter_groups(model_file, model, iterations)
    if groups:
        return OptimizerSpec(probe.class_name, probe.options, None, groups, probe.module)
    rates = probe_learning_rates(model_file, iterations)
    return OptimizerSpec(probe.class_name, probe.options, rates, module=probe.module)


def adapter_format(model: nn.Module) -> Literal["peft"] | None:
    """ "peft" when the model is a peft model (`get_peft_model(...)`), whose adapter the run saves
    with peft's own `save_pretrained`; recognised by its attributes, so peft is imported only by
    model files that use it."""
    if isinstance(getattr(model, "peft_config", None), dict) and callable(getattr(model, "save_pretrained", None)):
        return "peft"
    return None


def loss_source(model_file: ModelFile, out_spec: pytree.TreeSpec, flat_outputs: list[Any], targets: Any) -> str:
    """The loss as a torch-only module: `Stage()(*flat_outputs, *flat_targets)` returns the loss.

    Traced like the model (fx, else torch.export), so the last stage's function never imports the
    model file."""
    # no targets (None, a leaf to pytree): the model computes its own loss, and the loss module takes none
    flat_targets, target_spec = pytree.tree_flatten(targets) if targets is not None else ([], None)
    n_out = len(flat_outputs)
    names = [f"output_{i}" for i in range(n_out)] + [f"target_{i}" for i in range(len(flat_targets))]
    loss_fn = model_file.loss_fn

    def composed(*flat: Any) -> torch.Tensor:
        outputs = pytree.tree_unflatten(list(flat[:n_out]), out_spec)
        given = None if target_spec is None else pytree.tree_unflatten(list(flat[n_out:]), target_spec)
        return loss_fn(outputs, given)

    # A forward with one named argument per tensor, so the traced placeholders carry those names.
    namespace: dict[str, Any] = {"composed": composed}
    exec(f"def forward(self, {', '.join(names)}):\n    return composed({', '.join(names)})\n", namespace)
    module = type("Loss", (nn.Module,), {"forward": namespace["forward"]})()
    example = tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in [*flat_outputs, *flat_targets])
    program = trace_model(module, example, model_path=model_file.path)
    header = StageHeader(
        constants=_loss_constants(model_file, program.module),
        model=model_file.name,
        index=0,
        count=1,
        first_block=0,
        last_block=0,
        inputs=tuple(program.input_names),
        outputs=("loss",),
        tensors={},
        title=f"The loss of {model_file.name}: loss_fn(outputs, targets) on the last stage's flat outputs.",
    )
    try:
        return render_stage_source(program.module.graph, header)
    except ValueError as exc:
        raise CompileError(f"{model_file.shown}: loss_fn: {exc}") from exc


#: the largest constant tensor loss_fn may hold (written into loss.py as a literal), in elements
MAX_LOSS_CONSTANT = 4096


def _loss_constants(model_file: ModelFile, module: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors the traced loss reads as attributes (a class-weight table, a mask): small ones go
    into the source; a large or non-finite one is a compile error that says what to do instead."""
    constants: dict[str, torch.Tensor] = {}
    for node in module.graph.nodes:  # type: ignore[union-attr]
        if node.op != "get_attr":
            continue
        value: Any = module
        for part in str(node.target).split("."):
            value = getattr(value, part)
        if not isinstance(value, torch.Tensor):
            continue
        if "." in str(node.target):  # the tracers lift constants to top-level attributes
            raise CompileError(f"{model_file.shown}: loss_fn reads the tensor attribute {node.target}, unsupported")
        large = value.numel() > MAX_LOSS_CONSTANT
        if large or (value.is_floating_point() and not bool(value.isfinite().all())):
            why = "too large to write into loss.py" if large else "non-finite values"
            raise CompileError(
                f"{model_file.shown}: loss_fn uses a constant tensor of shape {tuple(value.shape)} ({why}); "
                f"expected at most {MAX_LOSS_CONSTANT} finite values: make it a buffer of the model and "
                "return what the loss needs from forward"
            )
        constants[str(node.target)] = value.detach().cpu()
    return constants


def portable_path(path: Path) -> str:
    """`path` as a build records it: relative to the folder the compiler ran in (as a user types
    it), never an absolute path of the compiling machine; `cloudless-run` resolves it from the
    same folder (or takes `--model`)."""
    if not path.is_absolute():
        return path.as_posix()
    return Path(os.path.relpath(path.resolve(), Path.cwd().resolve())).as_posix()


@dataclass(frozen=True)
class RegionTraining:
    """What one region trains: its plan, its iterations and (several regions) its data and rounds."""

    region: catalog.Region
    plan: Plan
    iterations: int
    samples: int | None
    #: (region, first, count): slices of load_shard(region, "train") it trains on (several regions)
    sources: tuple[tuple[str, int, int], ...] = ()
    weight: float | None = None


@dataclass(frozen=True)
class InterRegion:
    """How several regions' models meet: the strategy, rounds, ASGD-GA's server, the WAN links."""

    strategy: InterRegionSync
    rounds: int
    server: str | None
    links: tuple[tuple[str, str, float, float], ...]  # (a, b, MB/s, latency s)
    #: asgd-ga: versions a push's base may lag (None: default_staleness_bound of the training regions)
    staleness_bound: int | None = None


def lower_plan(
    trainings: list[RegionTraining],
    model_file: ModelFile,
    stages: list[StageInterface],
    *,
    iterations: int,
    global_batch: int,
    schedule: Schedule,
    input_names: list[str],
    target_count: int,
    optimizer: OptimizerSpec,
    inter_region: InterRegion | None = None,
    seed: int = 0,
    adapter: Literal["peft"] | None = None,
    fixed_shapes: bool = False,
) -> Workflow:
    """The workflow: each region trains its plan (the regions share the partition and micro-batch
    size) for its iterations of `global_batch`; `iterations` is the whole training's."""
    micro_batch = trainings[0].plan.micro_batch
    for training in trainings:
        if len(stages) != len(training.plan.stages) or training.plan.micro_batch != micro_batch:
            raise ValueError(f"{training.region.name}: its plan does not match the generated stages")
    if len(trainings) > 1 and inter_region is None:
        raise ValueError("several regions need an inter-region strategy")
    if inter_region is not None:
        if inter_region.server is not None and inter_region.server not in [t.region.name for t in trainings]:
            raise ValueError(f"the ASGD-GA server {inter_region.server} must be one of the training regions")
        for training in trainings:
            if not 1 <= inter_region.rounds <= training.iterations:
                raise ValueError(
                    f"{training.region.name}: {inter_region.rounds} rounds over {training.iterations} iterations; "
                    "the planner keeps rounds within every region's iterations"
                )
    run_name = slug(model_file.path.stem)
    holders: dict[str, list[int]] = {}
    for stage in stages:
        for name in stage.parameters:
            holders.setdefault(name, []).append(stage.index)
    shared = {name for name, held in holders.items() if len(held) > 1}
    every = checkpoint_interval(max(t.iterations for t in trainings))
    sync_kind = None if inter_region is None else SYNC_STEP_KIND[inter_region.strategy]
    regions: list[Region] = []
    steps: list[Step] = []
    for training in trainings:
        region = training.region
        functions = tuple(
            Function(
                name=f"{run_name}-s{stage.index}",
                stage=stage.index,
                blocks=(choice.first, choice.last),
                memory_mb=choice.tier_mb,
                cpu_millis=cpu_millis(region, choice.tier_mb),
                network_mb_per_s=round(region.bandwidth_bps(choice.tier_mb) / 1e6, 3),
                replicas=choice.replicas,
                timeout_s=int(region.timeout_s),
                package=f"regions/{region.name}/functions/{run_name}-s{stage.index}",
                inputs=stage.inputs,
                outputs=stage.outputs,
                shared_parameters=tuple(sorted(set(stage.parameters) & shared)),
                frozen_parameters=stage.frozen,
                staged_parameters=stage.staged,
            )
            for stage, choice in zip(stages, training.plan.stages, strict=True)
        )
        regions.append(
            Region(
                name=region.name,
                provider=region.provider,
                samples=training.samples,
                request_latency_s=region.request_latency_s,
                functions=functions,
                iterations=training.iterations,
                weight=training.weight if inter_region is not None else None,
                # also when one region trains alone on data moved to it
                data_sources=tuple(DataSource(r, f, c) for r, f, c in training.sources),
                prices=RegionPrices(
                    gb_second=region.prices.gb_second,
                    per_million_requests=region.prices.per_million_requests,
                    storage_put_per_1000=region.prices.storage_put_per_1000,
                    storage_get_per_1000=region.prices.storage_get_per_1000,
                    egress_per_gb=region.prices.egress_per_gb,
                ),
            )
        )
        steps.extend(region_steps(region.name, functions, holders, every, sync_kind))
    return Workflow(
        model=model_file.name,
        run=RunSettings(
            name=run_name,
            iterations=iterations,
            global_batch=global_batch,
            micro_batch=micro_batch,
            micro_batches=global_batch // micro_batch,
            schedule=schedule,
            checkpoint_every=every,
            seed=seed,
            max_grad_norm=float(clip) if (clip := model_file.training.get("max_grad_norm")) is not None else None,
            precision=model_file.training.get("precision", "32-true"),
        ),
        optimizer=optimizer,
        sync=SyncSettings(
            intra_region="pipelined-scatter-reduce",
            piece_bytes=SYNC_PIECE_BYTES,
            max_pieces=MAX_SYNC_PIECES,
            inter_region=None if inter_region is None else inter_region.strategy,
            rounds=None if inter_region is None else inter_region.rounds,
            server=None if inter_region is None else inter_region.server,
            staleness_bound=staleness_bound(inter_region, len(trainings)),
        ),
        storage=StorageSpec(bucket=f"cloudless-{run_name}", prefix=run_name),
        data=DataSpec(
            # The file whose load_shard(region, split) gives the data: as given to the compiler when
            # relative, never an absolute path of the compiling machine (see `portable_path`).
            model_file=portable_path(model_file.path),
            inputs=tuple(input_names),
            targets=target_count,
            loss=LOSS_MODULE,
            adapter=adapter,
            model_sha256=hashlib.sha256(model_file.path.read_bytes()).hexdigest(),
            fixed_shapes=fixed_shapes,
        ),
        regions=tuple(regions),
        steps=tuple(steps),
        wan=None
        if inter_region is None
        else tuple(WanLink((a, b), round(mb_per_s, 3), latency) for a, b, mb_per_s, latency in inter_region.links),
    )


def staleness_bound(inter_region: InterRegion | None, training_regions: int) -> int | None:
    """ASGD-GA's staleness bound as workflow.yaml writes it (None: not ASGD-GA)."""
    if inter_region is None or inter_region.strategy != "asgd-ga":
        return None
    if inter_region.staleness_bound is not None:
        return inter_region.staleness_bound
    return default_staleness_bound(training_regions)


def region_steps(
    region: str,
    functions: tuple[Function, ...],
    holders: dict[str, list[int]],
    checkpoint_every: int,
    sync_kind: StepKind | None = None,
) -> list[Step]:
    """One iteration's DAG in a region: the stages compute at once (they pipeline through storage).
    With several regions, each stage meets its counterparts in the others after its optimizer step
    (`cross-region-reduce` every iteration; `asgd-ga-push` or `model-average` at the ends of the
    region's rounds, `round_ends(region.iterations, sync.rounds)`, so the step has no `every`),
    before its checkpoint."""

    def step(function: Function, kind: StepKind, depends_on: list[str], every: int | None = None) -> Step:
        step_id = f"{region}/s{function.stage}/{kind}"
        return Step(step_id, kind, region, function.name, function.replicas, tuple(depends_on), every)

    steps: list[Step] = []
    gradients_ready: dict[int, str] = {}
    for function in functions:
        compute = step(function, "compute", [])
        steps.append(compute)
        gradients_ready[function.stage] = compute.id
        if function.replicas > 1:
            reduce = step(function, "scatter-reduce", [compute.id])
            steps.append(reduce)
            gradients_ready[function.stage] = reduce.id
    for function in functions:
        # A tied parameter's gradient is the sum over the stages holding it: wait for all of them.
        partners = sorted({s for name in function.shared_parameters for s in holders[name]} | {function.stage})
        update = step(function, "optimizer-step", [gradients_ready[s] for s in partners])
        steps.append(update)
        last = update.id
        if sync_kind is not None:
            meet = step(function, sync_kind, [update.id])
            steps.append(meet)
            last = meet.id
        steps.append(step(function, "checkpoint", [last], checkpoint_every))
    return steps


def cpu_millis(region: catalog.Region, memory_mb: int) -> int:
    """The CPU share the platform gives a function of this memory, in thousandths of a vCPU."""
    return max(1, round(1000 * region.vcpus(memory_mb)))
