"""The compiler's passes, top to bottom, in one function (`compile_model`): load → trace → annotate → buffer rules →
coarsen → profile → plan (and simulate the plan once) → split → verify → lower → render → write.

Each pass is a function with typed input and output, each returning a new value; `compile_model`
chains them, times each, and reports progress through a callback so the CLI (or a test) decides how
to show it. The CLI only parses arguments and prints the result.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ..codegen.libraries import UserImportError, third_party_imports
from ..codegen.platforms import TARGETS
from ..codegen.stage_source import StageHeader, TensorKind, calls_user_code, render_stage_source
from ..codegen.validate import check_build
from ..ir.blocks import BlockChain
from ..ir.graph import OpGraph
from ..ir.plan import TrainingPlan
from ..ir.protocol import PARQUET_READER, PARQUET_SUFFIX
from ..ir.workflow import Schedule, Workflow
from .build import build_files, write_build
from .errors import CompileError, ModelFileError, display_path
from .frontend.annotate import annotate_run, fetch_attr
from .frontend.buffer_rules import buffer_rules
from .frontend.coarsen import (
    DEFAULT_BLOCKS,
    MAX_BLOCK_PARAM_BYTES,
    balanced_ranges,
    block_cuts,
    coarsen,
    compute_positions,
)
from .frontend.model_file import (
    ModelFile,
    data_in_place,
    default_loss,
    load_model_file,
    probe_learning_rates,
    user_sources,
)
from .frontend.profile import loss_function, profile_blocks, reuse_profile
from .frontend.split import inline_leaf_modules, partition
from .frontend.stand_ins import holds_stand_ins, staged_parameter_names
from .frontend.state import preserved_state, release_free_memory
from .frontend.trace import TracedProgram, trace_model
from .frontend.verify import VerifyReport, verify_stages
from .lower import (
    InterRegion,
    Lowered,
    RegionTraining,
    StageCode,
    StageInterface,
    adapter_format,
    describe_optimizer,
    loss_source,
    lower_plan,
)
from .planner.geo import region_shares
from .planner.plan import PlanOptions, PlanResult, plan_training
from .planner.plan_record import plan_record
from .planner.simulate import Timeline, simulate

DEFAULT_BATCH_SIZE = 2
#: iterations a learning-rate schedule is first checked over when TRAINING gives none (epochs)
EARLY_SCHEDULE_ITERATIONS = 16


@dataclass(frozen=True)
class FrontEndOptions:
    model_path: Path
    batch_size: int | None = None
    num_blocks: int = DEFAULT_BLOCKS
    #: the most bytes of parameters a block holds where the graph can be cut that finely (coarsen.py)
    max_block_bytes: int = MAX_BLOCK_PARAM_BYTES
    leaf_modules: Sequence[str] = ()
    tracer: Literal["auto", "fx", "export"] = "auto"
    profile_repeats: int = 3
    #: reuse the block times of an earlier build's ir/blocks.json instead of measuring
    profile_from: Path | None = None
    #: build the model with stand-ins for its weights (stand_ins.py): plan from shapes, and a build
    #: whose parameters the run stages; None: when the weights take more than STAGED_WEIGHTS_BYTES
    stand_ins: bool | None = False


@dataclass(frozen=True)
class CompileOptions:
    front: FrontEndOptions
    #: None: no plan (and so no functions), only the front end's files
    plan: PlanOptions | None = None
    #: stages --verify splits into when there is no plan (0: no verification)
    verify_stages: int = 0
    #: split the plan into stages and write their function packages (False: the plan, report and ir/ only)
    packages: bool = True
    targets: frozenset[str] = TARGETS
    #: the build folder (None: the build's files are returned, not written)
    output: Path | None = None


@dataclass(frozen=True)
class FrontEnd:
    """The traced, annotated, coarsened and profiled model."""

    model_file: ModelFile
    model: nn.Module
    program: TracedProgram
    graph: OpGraph
    chain: BlockChain
    example_inputs: tuple[Any, ...] = ()
    example_targets: Any = None
    #: the program's flat outputs on the example inputs (annotation's run, detached)
    flat_outputs: tuple[Any, ...] = ()


@dataclass(frozen=True)
class Compiled:
    """Everything a compile produced, for the CLI to print (and tests to inspect)."""

    front: FrontEnd
    plan: PlanResult | None
    #: the plan as plan.json records it: baselines simulated, the explanation solved (the plan pass's)
    record: TrainingPlan | None
    plan_options: PlanOptions | None
    #: the chosen plan's simulated iteration
    timeline: Timeline | None
    stages: tuple[StageCode, ...]
    verify: VerifyReport | None
    lowered: Lowered | None
    files: dict[str, bytes]
    timings: dict[str, float]

    @property
    def workflow(self) -> Workflow | None:
        return None if self.lowered is None else self.lowered.workflow


Announce = Callable[[str], AbstractContextManager[Any]]


def compile_model(options: CompileOptions, step: Announce | None = None) -> Compiled:
    """Every pass from the model file to the written build, in order; `step(name)` returns a context
    manager shown while a pass runs (the CLI's spinner)."""
    timings: dict[str, float] = {}
    timed = _timer(timings, step)
    front = run_front_end(options.front, timed)
    planned = timeline = record = None
    if options.plan is not None and front.chain.machine is not None:
        with timed("plan"):
            planned = plan_training(front.chain, front.model_file, options.plan)
            timeline = simulate(planned.problem, planned.solution.plan)
            record = plan_record(planned, front.chain, options.plan, timeline)
    # The stages run at the plan's micro-batch: trace again at that size when the profile's differs
    # (torch.export bakes the traced sizes into reshapes; a stage traced at 2 fails on 8 rows).
    runs_at = front
    if planned is not None and options.packages and planned.solution.plan.micro_batch != front.chain.batch_size:
        with timed("retrace"):
            runs_at = retrace(front, planned.solution.plan.micro_batch, options.front)
    ranges: list[tuple[int, int]] = []
    split_from = ""
    if planned is not None and options.packages:
        ranges = [(s.first, s.last) for s in planned.solution.plan.stages]
        split_from = "the plan's split"
    elif options.verify_stages > 0:
        ranges = balanced_stage_ranges(front.chain, options.verify_stages)
        split_from = f"a balanced split into {options.verify_stages} (no plan)"
    stages: tuple[StageCode, ...] = ()
    if ranges:
        with timed("split"):
            stages = generate_stages(runs_at.program, runs_at.graph, front.chain, ranges, front.model_file.path)
    verify = None
    # stand-ins hold no weights to compare the stages on (a staged build, or --plan-only)
    if options.verify_stages > 0 and not holds_stand_ins(front.model):
        with timed("verify"), preserved_state(front.model):
            verify = verify_stages(
                runs_at.model,
                runs_at.example_inputs,
                runs_at.example_targets,
                front.model_file.loss_fn,
                [(s.source, s.state, list(s.inputs), list(s.outputs)) for s in stages],
                runs_at.program.out_spec,
            )
            verify.ranges = tuple(ranges)
            verify.batch_size = runs_at.graph.batch_size
            verify.split_from = split_from
    lowered = None
    if planned is not None and options.packages:
        with timed("lower"):
            trainings, inter_region = region_trainings(planned)
            problem = planned.problem
            lowered = lower(
                runs_at,
                trainings,
                inter_region,
                iterations=problem.iterations,
                global_batch=problem.global_batch,
                schedule=problem.schedule,
                stages=stages,
            )
    with timed("write"):
        files = build_files(front.graph, front.chain, record, options.plan, timeline, lowered, options.targets)
        if options.output is not None:
            write_build(
                files,
                options.output,
                check=check_build if lowered is not None else None,
                protected=[options.front.model_path],
            )
    return Compiled(front, planned, record, options.plan, timeline, stages, verify, lowered, files, timings)


def run_front_end(options: FrontEndOptions, timed: Announce | None = None) -> FrontEnd:
    """load -> trace -> annotate -> buffer rules -> coarsen -> (check the loss) -> profile."""
    timed = timed or _timer({}, None)
    with timed("load"):
        model_file = load_model_file(options.model_path)
        batch_size = options.batch_size or _default_batch_size(model_file)
        model, example_inputs, targets = model_file.instantiate(batch_size, stand_ins=options.stand_ins)
        flat_inputs = pytree.tree_leaves(example_inputs)
        # A schedule the functions cannot follow is an error now, not after tracing, profiling and
        # planning (lowering records it over the run's iterations, known only then with epochs).
        probe_learning_rates(model_file, model_file.training.get("iterations") or EARLY_SCHEDULE_ITERATIONS)
    with preserved_state(model):
        model_file.check_inputs_fit(model, example_inputs, batch_size)
        with timed("trace"):
            program = trace_model(
                model,
                example_inputs,
                model_path=options.model_path,
                leaf_modules=options.leaf_modules,
                tracer=options.tracer,
            )
        with timed("annotate"):
            graph, flat_outputs = annotate_run(program, flat_inputs, model_file.name, batch_size)
            graph = replace(graph, buffer_rules=buffer_rules(model, program, graph.mutated_buffers))
            release_free_memory()
        with timed("coarsen"):
            # under bf16-mixed, activations cross stages in bf16: the cuts' bytes as they are sent
            bf16_mixed = model_file.training.get("precision") == "bf16-mixed"
            chain = coarsen(graph, options.num_blocks, bf16_mixed, options.max_block_bytes)
        loss_of = loss_function(program.out_spec, model_file.loss_fn, targets)
        _check_loss(model_file, flat_outputs, loss_of)
        if options.profile_from is not None:
            chain = reuse_profile(chain, options.profile_from)
        elif options.profile_repeats > 0:
            with timed("profile"):
                chain = profile_blocks(
                    program, graph, chain, flat_inputs, loss_of, options.profile_repeats, bf16_mixed=bf16_mixed
                )
    return FrontEnd(model_file, model, program, graph, chain, example_inputs, targets, flat_outputs)


def retrace(front: FrontEnd, batch_size: int, options: FrontEndOptions) -> FrontEnd:
    """The front end at another micro-batch: the same model traced (with the tracer that traced it) and
    annotated on example inputs of `batch_size`, keeping the profiled block chain. The chain's cut
    positions must name the same operations in both traces; a model whose graph depends on the batch
    size is a compile error."""
    model_file, model = front.model_file, front.model
    with preserved_state(model):
        example_inputs, targets = model_file.examples(batch_size)
        model_file.check_inputs_fit(model, example_inputs, batch_size)
        flat_inputs = pytree.tree_leaves(example_inputs)
        program = trace_model(
            model,
            example_inputs,
            model_path=options.model_path,
            leaf_modules=options.leaf_modules,
            tracer=front.program.tracer,
        )
        graph, flat_outputs = annotate_run(program, flat_inputs, model_file.name, batch_size)
        graph = replace(graph, buffer_rules=buffer_rules(model, program, graph.mutated_buffers))
        release_free_memory()
    traced = [(n.name, n.target) for n in compute_positions(front.graph)]
    again = [(n.name, n.target) for n in compute_positions(graph)]
    if traced != again:
        pairs = zip(traced, again, strict=False)
        first = next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(traced), len(again)))
        shown = traced[first][0] if first < len(traced) else again[first][0]
        raise CompileError(
            f"{display_path(options.model_path)}: the model traces to another graph at micro-batch {batch_size} "
            f"than at {front.graph.batch_size} (the plan's micro-batch and the profiled one; they differ from "
            f"operation {first}, {shown}): its code depends on the batch size. Fix: trace at the size it runs "
            f"with --batch-size {batch_size}, or give TRAINING['micro_batch_sizes'] one size"
        )
    return FrontEnd(model_file, model, program, graph, front.chain, example_inputs, targets, flat_outputs)


def lower(
    front: FrontEnd,
    trainings: list[RegionTraining],
    inter_region: InterRegion | None,
    *,
    iterations: int,
    global_batch: int,
    schedule: Schedule,
    stages: tuple[StageCode, ...] = (),
) -> Lowered:
    """The plans' stages (generated unless `stages` already split at the plans' ranges), the loss
    module and the workflow."""
    ranges = [(s.first, s.last) for s in trainings[0].plan.stages]
    if [(s.first_block, s.last_block) for s in stages] != ranges:
        stages = generate_stages(front.program, front.graph, front.chain, ranges, front.model_file.path)
    model_file, program = front.model_file, front.program
    flat_outputs = list(front.flat_outputs)
    if not flat_outputs:  # a front end made without annotation's outputs
        with preserved_state(front.model), torch.no_grad():
            flat_outputs = list(program.module(*pytree.tree_leaves(front.example_inputs)))
    loss = loss_source(model_file, program.out_spec, flat_outputs, front.example_targets)
    if holds_stand_ins(front.model):  # a staged build: the run brings the parameters' weights
        stages = tuple(replace(s, staged=staged_parameter_names(front.model, s.state)) for s in stages)
    interfaces = [StageInterface(s.index, s.inputs, s.outputs, s.trainable, s.frozen, s.staged) for s in stages]
    workflow = lower_plan(
        trainings,
        model_file,
        interfaces,
        iterations=iterations,
        global_batch=global_batch,
        schedule=schedule,
        input_names=program.input_names,
        target_count=0 if front.example_targets is None else len(pytree.tree_leaves(front.example_targets)),
        optimizer=describe_optimizer(model_file, iterations, front.model),
        inter_region=inter_region,
        adapter=adapter_format(front.model),
        fixed_shapes=program.tracer == "export",
    )
    in_place = data_in_place(model_file, [region.name for region in workflow.regions])
    # a function imports the model file (and the modules beside it) for its data's transform, for the user's
    # functions its stage code calls, and for an optimizer outside torch.optim
    ships_user_code = workflow.optimizer.module is not None or any(calls_user_code(s.source) for s in stages)
    if not in_place and not ships_user_code:
        return Lowered(stages, loss, workflow)
    # recorded in the workflow: what a deployed first stage's role may read (codegen/platforms.py)
    regions = tuple(replace(region, data_in_place=tuple(in_place.get(region.name, ()))) for region in workflow.regions)
    workflow = replace(workflow, regions=regions)
    # the first stage reads the shards through the model file's transform, and stage code may call its own
    # functions: the packages hold the file, its neighbours, what they import, and Parquet's reader when the
    # shards are Parquet files
    sources = user_sources(model_file.path)
    try:
        imports = set(third_party_imports(sources, model_file.path.name))
    except UserImportError as exc:
        raise ModelFileError(f"{display_path(model_file.path.parent)}/{exc}") from None
    if any(location.lower().endswith(PARQUET_SUFFIX) for patterns in in_place.values() for location in patterns):
        imports.add(PARQUET_READER)
    return Lowered(stages, loss, workflow, tuple(sources.items()), tuple(sorted(imports)))


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
    program: TracedProgram,
    graph: OpGraph,
    chain: BlockChain,
    ranges: list[tuple[int, int]],
    model_file: Path | None = None,
) -> tuple[StageCode, ...]:
    """Split at the block ranges and generate each stage's source and weights: torch's and the standard
    library's calls, and those of the `model_file`'s own functions the trace kept (fx.wrap helpers)."""
    parts = partition(program, graph, block_cuts(chain, ranges))
    stages = []
    for part, (first, last) in zip(parts, ranges, strict=True):
        inlined = inline_leaf_modules(part, graph, program)
        tensors = {}
        state = {}
        for name in _stage_tensor_names(inlined.module, program):
            tensor = fetch_attr(inlined.module, name)
            info = graph.parameters.get(name)
            trainable = info.trainable if info else isinstance(tensor, nn.Parameter) and tensor.requires_grad
            kind: TensorKind = "parameter" if trainable else "frozen" if isinstance(tensor, nn.Parameter) else "buffer"
            tensors[name] = (tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."), kind)
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
            model_file=None if model_file is None else str(model_file),
            buffer_rules={
                name: (rule.rule, rule.momentum) for name, rule in graph.buffer_rules.items() if name in tensors
            },
        )
        try:
            source = render_stage_source(inlined.module.graph, header)
        except ValueError as exc:  # a program the stage code cannot hold: the model's, not a crash
            raise CompileError(f"{graph.model}: stage {part.index} (blocks {first}-{last}): {exc}") from exc
        of_kind = {k: tuple(n for n, (_, _, kind) in tensors.items() if kind == k) for k in ("parameter", "frozen")}
        stages.append(
            StageCode(
                part.index,
                first,
                last,
                source,
                state,
                tuple(part.inputs),
                tuple(part.outputs),
                of_kind["parameter"],
                of_kind["frozen"],
            )
        )
    return tuple(stages)


def _stage_tensor_names(module: torch.fx.GraphModule, program: TracedProgram) -> list[str]:
    names: list[str] = []
    for node in module.graph.nodes:
        if node.op == "get_attr" and isinstance(fetch_attr(module, str(node.target)), torch.Tensor):
            if node.target not in names:
                names.append(str(node.target))
        if node.op == "call_module":  # a library module: its tensors sit where the stage rebuilds it
            library = module.get_submodule(str(node.target))
            for local, tensor in [*library.named_parameters(), *library.named_buffers()]:
                name = f"{node.target}.{local}"
                if program.tensor_name(tensor, name) != name:
                    raise CompileError(
                        f"{name} is also {program.tensor_name(tensor, name)}: a library module run as its own code "
                        "cannot share a tensor with another module"
                    )
                if name not in names:
                    names.append(name)
    return names


def balanced_stage_ranges(chain: BlockChain, stages: int) -> list[tuple[int, int]]:
    """Contiguous block ranges with about equal measured (else FLOP) cost, for --verify."""
    costs = [b.forward_s + b.backward_s or float(b.flops + 1) for b in chain.blocks]
    return balanced_ranges(costs, min(stages, len(chain.blocks)))


def _default_batch_size(model_file: ModelFile) -> int:
    sizes = model_file.training.get("micro_batch_sizes") or []
    return max(min(sizes), 1) if sizes else DEFAULT_BATCH_SIZE


def _check_loss(model_file: ModelFile, outputs: tuple[Any, ...], loss_of: Any) -> None:
    """Run the loss once on the model's flat `outputs` so a broken loss_fn/example_targets fails here,
    naming its line."""
    default = model_file.loss_fn is default_loss
    # the default loss is no code of the user's: named as such, and what it needs said
    name = (
        "the default loss (cross-entropy: the model file defines no loss_fn)" if default else "loss_fn(output, target)"
    )
    if default and model_file.example_targets is None:
        # no targets: the default loss is the model's own (`output.loss`, from its labels input)
        try:
            loss_of(outputs)
        except TypeError:
            raise ModelFileError(
                f"{model_file.shown}: defines neither loss_fn(output, target) nor example_targets(batch_size), and "
                "the model's output has no loss; the default loss (cross-entropy) needs targets. Fix: define "
                "example_targets, or a loss_fn of your own, or give the model its labels so it returns output.loss"
            ) from None
        name = "the model's own loss (output.loss: the model file defines no loss_fn and no example_targets)"
    try:
        loss = loss_of(outputs)
    except Exception as exc:
        if default:
            raise ModelFileError(
                f"{model_file.shown}: {name} raised {type(exc).__name__}: {exc}. Fix: define loss_fn(output, "
                "target) for this model's output"
            ) from exc
        raise model_file.error_at(exc, f"{name} raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ModelFileError(f"{model_file.shown}: {name} returned {type(loss).__name__}; expected a scalar tensor")


def _timer(timings: dict[str, float], announce: Announce | None) -> Announce:
    """A `timed(name)` context manager: shows the pass through `announce`, records its seconds."""

    @contextmanager
    def timed(name: str) -> Iterator[None]:
        start = time.perf_counter()
        with announce(name) if announce is not None else nullcontext():
            yield
        timings[name] = timings.get(name, 0.0) + time.perf_counter() - start

    return timed
