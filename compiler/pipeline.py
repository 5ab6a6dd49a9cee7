"""The compiler's passes, top to bottom: load → trace → annotate → coarsen → profile → plan → split → verify → lower.

Each pass is a function with typed input and output; `run_front_end` chains them, times each, and
reports progress through a callback so the CLI (or a test) decides how to show it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn
from torch.utils import _pytree as pytree

from cloudless.codegen.stage_source import StageHeader, render_stage_source
from cloudless.compiler.annotate import annotate, fetch_attr
from cloudless.compiler.coarsen import DEFAULT_BLOCKS, balanced_ranges, block_cuts, coarsen
from cloudless.compiler.errors import ModelFileError
from cloudless.compiler.geo import region_shares
from cloudless.compiler.lower import (
    InterRegion,
    RegionTraining,
    StageInterface,
    describe_optimizer,
    loss_source,
    lower_plan,
)
from cloudless.compiler.model_file import ModelFile, load_model_file
from cloudless.compiler.plan import PlanOptions, PlanResult, plan_training
from cloudless.compiler.profile import loss_function, profile_blocks, reuse_profile
from cloudless.compiler.split import inline_leaf_modules, partition
from cloudless.compiler.state import preserved_state
from cloudless.compiler.trace import TracedProgram, trace_model
from cloudless.compiler.verify import VerifyReport, verify_stages
from cloudless.ir import BlockChain, OpGraph
from cloudless.ir.schedule import Schedule

DEFAULT_BATCH_SIZE = 2


@dataclass
class FrontEndOptions:
    model_path: Path
    batch_size: int | None = None
    num_blocks: int = DEFAULT_BLOCKS
    leaf_modules: Sequence[str] = ()
    tracer: Literal["auto", "fx", "export"] = "auto"
    profile_repeats: int = 3
    #: reuse the block times of an earlier build's ir/blocks.json instead of measuring
    profile_from: Path | None = None
    verify_stages: int = 0
    plan: PlanOptions | None = None


@dataclass
class StageCode:
    """A generated stage: its source, its slice of the weights, and what it takes and returns."""

    index: int
    first_block: int
    last_block: int
    source: str
    state: dict[str, torch.Tensor]
    inputs: list[str]
    outputs: list[str]
    #: names of the trainable tensors in `state`
    trainable: list[str] = field(default_factory=list)


@dataclass
class FrontEndResult:
    model_file: ModelFile
    model: nn.Module
    program: TracedProgram
    graph: OpGraph
    chain: BlockChain
    example_inputs: tuple[Any, ...] = ()
    example_targets: Any = None
    stages: list[StageCode] = field(default_factory=list)
    verify: VerifyReport | None = None
    plan: PlanResult | None = None
    plan_options: PlanOptions | None = None
    #: workflow.yaml's content and the loss module's source, when there is a plan
    workflow: dict[str, Any] | None = None
    loss_source: str = ""
    timings: dict[str, float] = field(default_factory=dict)


def run_front_end(options: FrontEndOptions, step: Callable[[str], Any] | None = None) -> FrontEndResult:
    """Run every front-end pass; `step(name)` returns a context manager shown while a pass runs."""
    timings: dict[str, float] = {}
    announce = step or (lambda name: _null())

    @contextmanager
    def timed(name: str) -> Iterator[None]:
        start = time.perf_counter()
        with announce(name):
            yield
        timings[name] = time.perf_counter() - start

    with timed("load"):
        model_file = load_model_file(options.model_path)
        batch_size = options.batch_size or _default_batch_size(model_file)
        model, example_inputs, targets = model_file.instantiate(batch_size)
        flat_inputs = pytree.tree_leaves(example_inputs)
    with preserved_state(model):
        with timed("trace"):
            program = trace_model(
                model,
                example_inputs,
                model_path=options.model_path,
                leaf_modules=options.leaf_modules,
                tracer=options.tracer,
            )
        with timed("annotate"):
            graph = annotate(program, flat_inputs, model_file.name, batch_size)
        with timed("coarsen"):
            chain = coarsen(graph, options.num_blocks)
        loss_of = loss_function(program.out_spec, model_file.loss_fn, targets)
        _check_loss(model_file, program, flat_inputs, loss_of)
        if options.profile_from is not None:
            chain = reuse_profile(chain, options.profile_from)
        elif options.profile_repeats > 0:
            with timed("profile"):
                chain = profile_blocks(program, graph, chain, flat_inputs, loss_of, options.profile_repeats)
    result = FrontEndResult(model_file, model, program, graph, chain, example_inputs, targets, timings=timings)
    if options.plan is not None and chain.machine is not None:
        with timed("plan"):
            result.plan = plan_training(chain, model_file, options.plan)
            result.plan_options = options.plan
    ranges: list[tuple[int, int]] = []
    if result.plan is not None:
        ranges = [(s.first, s.last) for s in result.plan.solution.plan.stages]
    elif options.verify_stages > 0:
        ranges = balanced_stage_ranges(chain, options.verify_stages)
    if ranges:
        with timed("split"):
            result.stages = generate_stages(program, graph, chain, ranges)
    if options.verify_stages > 0:
        with timed("verify"), preserved_state(model):
            result.verify = verify_stages(
                model,
                example_inputs,
                targets,
                model_file.loss_fn,
                [(s.source, s.state, s.inputs, s.outputs) for s in result.stages],
                program.out_spec,
            )
    if result.plan is not None:
        with timed("lower"):
            lower_training(result, result.plan)
    return result


def lower_training(result: FrontEndResult, planned: PlanResult) -> None:
    """Lower the planning pass's result (one region or several) into `result`."""
    problem = planned.problem
    trainings, inter_region = region_trainings(planned)
    lower_trainings(
        result,
        trainings,
        inter_region,
        iterations=problem.iterations,
        global_batch=problem.global_batch,
        schedule=problem.schedule,
    )


def lower_trainings(
    result: FrontEndResult,
    trainings: list[RegionTraining],
    inter_region: InterRegion | None,
    *,
    iterations: int,
    global_batch: int,
    schedule: Schedule,
) -> None:
    """Generate the plans' stages (unless done), the loss module and workflow.yaml, into `result`."""
    ranges = [(s.first, s.last) for s in trainings[0].plan.stages]
    if [(s.first_block, s.last_block) for s in result.stages] != ranges:
        result.stages = generate_stages(result.program, result.graph, result.chain, ranges)
    model_file, program = result.model_file, result.program
    targets = result.example_targets
    with preserved_state(result.model), torch.no_grad():
        flat_outputs = list(program.module(*pytree.tree_leaves(result.example_inputs)))
    result.loss_source = loss_source(model_file, program.out_spec, flat_outputs, targets)
    interfaces = [StageInterface(s.index, tuple(s.inputs), tuple(s.outputs), tuple(s.trainable)) for s in result.stages]
    result.workflow = lower_plan(
        trainings,
        model_file,
        interfaces,
        iterations=iterations,
        global_batch=global_batch,
        schedule=schedule,
        input_names=program.input_names,
        target_count=len(pytree.tree_leaves(targets)),
        optimizer=describe_optimizer(model_file),
        inter_region=inter_region,
    )


def region_trainings(planned: PlanResult) -> tuple[list[RegionTraining], InterRegion | None]:
    """Per training region, its plan and share of the training (one region: all of it)."""
    problem = planned.problem
    geo = planned.geo
    if geo is None:
        only = RegionTraining(planned.region, planned.solution.plan, problem.iterations, problem.samples_per_epoch)
        return [only], None
    shares = region_shares(geo.problem, geo.solution.plan)
    trainings = []
    for share in shares:
        chosen = geo.regions[share.site]
        assert chosen is not None
        trainings.append(
            RegionTraining(
                chosen.region,
                chosen.solution.plan,
                share.iterations,
                share.samples,
                share.sources,
                share.round_iterations,
                share.weight,
            )
        )
    names = [t.region.name for t in trainings]
    server = geo.solution.plan.server
    links = tuple(
        (a, b, link.bandwidth_bps / 1e6, link.latency_s)
        for i, a in enumerate(names)
        for b in names[i + 1 :]
        for link in [geo.problem.link(a, b)]
    )
    inter = InterRegion(
        geo.problem.sync,
        geo.problem.rounds,
        geo.problem.sites[server].name if server is not None and len(trainings) > 1 else None,
        links,
    )
    return trainings, inter if len(trainings) > 1 else None


def generate_stages(
    program: TracedProgram, graph: OpGraph, chain: BlockChain, ranges: list[tuple[int, int]]
) -> list[StageCode]:
    """Split at the block ranges and generate each stage's torch-only source and weights."""
    parts = partition(program, graph, block_cuts(chain, ranges))
    stages = []
    for part, (first, last) in zip(parts, ranges, strict=True):
        inlined = inline_leaf_modules(part, graph, program)
        tensors = {}
        state = {}
        for name in _stage_tensor_names(inlined.module):
            tensor = fetch_attr(inlined.module, name)
            info = graph.parameters.get(name)
            trainable = info.trainable if info else isinstance(tensor, nn.Parameter)
            tensors[name] = (tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."), trainable)
            state[name] = tensor.detach()  # loading a stage copies it; no clone needed
        header = StageHeader(
            model=graph.model,
            index=part.index,
            count=len(parts),
            first_block=first,
            last_block=last,
            inputs=tuple(part.inputs),
            outputs=tuple(part.outputs),
            tensors=tensors,
        )
        source = render_stage_source(inlined.module.graph, header)
        trainable_names = [name for name, (_, _, trainable) in tensors.items() if trainable]
        stages.append(
            StageCode(part.index, first, last, source, state, list(part.inputs), list(part.outputs), trainable_names)
        )
    return stages


def _stage_tensor_names(module: torch.fx.GraphModule) -> list[str]:
    names: list[str] = []
    for node in module.graph.nodes:
        if node.op == "get_attr" and isinstance(fetch_attr(module, str(node.target)), torch.Tensor):
            if node.target not in names:
                names.append(str(node.target))
    return names


def balanced_stage_ranges(chain: BlockChain, stages: int) -> list[tuple[int, int]]:
    """Contiguous block ranges with about equal measured (else FLOP) cost, for --verify."""
    costs = [b.forward_s + b.backward_s or float(b.flops + 1) for b in chain.blocks]
    return balanced_ranges(costs, min(stages, len(chain.blocks)))


def _default_batch_size(model_file: ModelFile) -> int:
    sizes = model_file.training.get("micro_batch_sizes") or []
    return max(min(sizes), 1) if sizes else DEFAULT_BATCH_SIZE


def _check_loss(model_file: ModelFile, program: TracedProgram, flat_inputs: list[Any], loss_of: Any) -> None:
    """Run the loss once so a broken loss_fn/example_targets fails here, naming its line."""
    with torch.no_grad():
        outputs = tuple(program.module(*flat_inputs))
    try:
        loss = loss_of(outputs)
    except Exception as exc:  # noqa: BLE001 - reported with the user's line
        raise model_file.error_at(exc, f"loss_fn(output, target) raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ModelFileError(
            f"{model_file.path.name}: loss_fn(output, target) returned {type(loss).__name__}; expected a scalar tensor"
        )


@contextmanager
def _null() -> Iterator[None]:
    yield
