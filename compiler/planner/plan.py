"""The planning pass: block chain + catalog + training settings -> the chosen plan and baselines.

When nothing fits, one error names the tightest bound and what would make the request feasible.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ...ir import BlockChain
from ...ir.catalog import Catalog, Link, Region, load_catalog, platform_limits
from ...ir.sample_order import HELD_SHARDS
from ...ir.schema import SchemaError
from ...runtimes.storage.shards import in_place_pattern, index_split
from ..errors import CompileError
from ..frontend.model_file import ModelFile, data_in_place, probe_optimizer
from .baselines import Baseline, baselines
from .cost_model import (
    MB,
    CostModel,
    DataInPlace,
    Objective,
    Plan,
    Problem,
    Schedule,
    StageChoice,
    problem_from_chain,
)
from .geo import (
    GeoInfeasible,
    GeoProblem,
    GeoSolution,
    RegionOption,
    RegionSite,
    SyncStrategy,
    solve_geo,
)
from .pipeline_milp import solve
from .pipeline_program import Infeasible, OutOfTime, Solution, check_objective, stage_configs


class PlanInfeasible(CompileError):
    """No plan satisfies the request."""


@dataclass
class PlanOptions:
    catalog: Path | None = None
    region: str | None = None
    objective: Objective = "cost"
    deadline: float | None = None
    budget: float | None = None
    max_functions: int | None = None
    schedule: Schedule = "gpipe"
    max_stages: int = 16
    #: plan exactly this many stages (cloudless-compile --stages N); None: any number up to max_stages
    stages: int | None = None
    replicas: tuple[int, ...] = (1, 2, 4, 8)
    time_limit: float = 10.0
    #: train in these regions (more than one: the inter-region schedule of compiler/planner/geo.py)
    regions: tuple[str, ...] = ()
    sync: SyncStrategy = "asgd-ga"
    sync_every: int = 10
    #: the deployment files that will be built ("openfaas", "sam"): their platforms' limits are the plan's
    #: (cloudless.ir.catalog.platform_limits)
    targets: frozenset[str] = frozenset({"openfaas", "sam"})
    #: where the OpenFaaS images are pushed (cloudless-compile --registry; None: each region's catalog entry)
    registry: str | None = None


@dataclass
class PlanResult:
    region: Region
    problem: Problem
    solution: Solution
    baselines: list[Baseline] = field(default_factory=list)
    #: with several regions: the schedule between them (this result is then the partition's source)
    geo: GeoResult | None = None
    #: the run's iterations and where the number came from
    run_length: RunLength | None = None


@dataclass
class GeoBaseline:
    name: str
    description: str
    solution: GeoSolution | None
    reason: str = ""


@dataclass
class GeoResult:
    problem: GeoProblem
    solution: GeoSolution
    #: per site of the problem: the level-1 result of the option it trains with (None: it does not)
    regions: list[PlanResult | None]
    baselines: list[GeoBaseline]


def build_problem(
    chain: BlockChain, model_file: ModelFile, options: PlanOptions, region_name: str | None = None
) -> tuple[Region, Problem]:
    try:
        catalog: Catalog = load_catalog(options.catalog)
        region = catalog.region(region_name or options.region)
    except SchemaError as exc:
        raise CompileError(str(exc)) from exc
    training = model_file.training
    count = "iterations" not in model_file.training or len(set(options.regions)) > 1
    samples, data = _training_data(model_file, region.name, count=count)
    micro_batches = tuple(training.get("micro_batch_sizes") or [chain.batch_size])
    global_batch = training.get("global_batch_size") or max(micro_batches) * 8
    usable = [mu for mu in micro_batches if global_batch % mu == 0]
    if not usable:
        raise CompileError(
            f"{model_file.shown}: TRAINING['micro_batch_sizes'] {list(micro_batches)}: none divides "
            f"global_batch_size {global_batch}"
        )
    problem = problem_from_chain(
        chain,
        region,
        global_batch=global_batch,
        micro_batches=tuple(usable),
        schedule=options.schedule,
        optimizer_state=probe_optimizer(model_file).state_per_parameter,
        replicas=options.replicas,
        max_stages=options.stages or options.max_stages,
        max_functions=options.max_functions,
        iterations=1,
        samples_per_epoch=samples,
        data=data,
        platform=platform_limits(region, options.targets),
    )
    if options.stages is not None and problem.max_stages < options.stages:
        limit = f"{len(chain.blocks)} blocks" if len(chain.blocks) < options.stages else problem.stage_limit_source()
        raise CompileError(f"--stages {options.stages}: no plan has that many stages: {limit}")
    length = run_length(model_file, samples, problem.global_batch)
    return region, dataclasses.replace(
        problem,
        iterations=length.iterations,
        min_stages=options.stages or 1,
        clipped=training.get("max_grad_norm") is not None,
    )


@dataclass(frozen=True)
class RunLength:
    """How many iterations the run trains, and where the number came from (for the summary)."""

    iterations: int
    source: str


def run_length(model_file: ModelFile, samples: int | None, global_batch: int) -> RunLength:
    """TRAINING['iterations'] as given; TRAINING['epochs'] passes over the training data (`samples`, from
    load_shard) at the global batch, ceil(epochs x samples / global batch) iterations; with neither, one
    epoch of the data, or a single iteration when the model file gives no data to size it."""
    training = model_file.training
    if "iterations" in training:
        return RunLength(int(training["iterations"]), "TRAINING['iterations']")
    epochs = training.get("epochs")
    if not samples:
        if epochs is not None:
            raise CompileError(
                f"{model_file.shown}: TRAINING['epochs'] needs the training data's size, and load_shard(region, "
                "'train') gives none (no load_shard, a dataset without len(), or shards where they lie, which "
                "cloudless-run indexes); give TRAINING['iterations']"
            )
        return RunLength(1, "default: no TRAINING['iterations'] or ['epochs'], and no load_shard data to size an epoch")
    passes = int(epochs or 1)
    iterations = math.ceil(passes * samples / global_batch)
    what = f"TRAINING['epochs'] {passes}" if epochs is not None else "default: one epoch"
    return RunLength(iterations, f"{what} of {samples:,} samples at global batch {global_batch}")


def _training_data(model_file: ModelFile, region: str, *, count: bool) -> tuple[int | None, DataInPlace | None]:
    """The training split's size in this region, when the model file says where data lies, and what a first
    stage reading it in place holds and reads. Shards where they lie are indexed by the same code the
    controller indexes them with (`runtimes/storage/shards.py`: headers, footers or a wids index; never a
    sample): always their sizes (a HEAD each: the cache the first stage's memory holds), and their counts
    when the plan needs them (`count`: an epoch's length, or the data's share of several regions; a tar
    shard's count is a scan of its headers)."""
    if model_file.load_shard is None:
        return None, None
    shard = model_file.call("load_shard", region, "train")
    pattern = in_place_pattern(shard, model_file.path.resolve().parent)
    if pattern is None:
        try:
            return len(shard), None
        except TypeError:
            return None, None
    try:
        index = index_split(pattern, count=count)
    except ValueError as exc:  # ShardError, ObjectError: a missing, unreadable or damaged shard
        raise CompileError(f"{model_file.shown}: load_shard({region!r}, 'train'): {exc}") from None
    groups = collections.Counter(entry.location for entry in index.entries)  # a Parquet file's row groups
    largest = max(entry.size / groups[entry.location] for entry in index.entries)
    data = DataInPlace(held_bytes=math.ceil(HELD_SHARDS * largest))
    if index.samples:
        total = sum(entry.size / groups[entry.location] for entry in index.entries)
        data = dataclasses.replace(
            data, bytes_per_sample=total / index.samples, samples_per_shard=index.samples / len(index.entries)
        )
    return (index.samples or None), data


def plan_training(chain: BlockChain, model_file: ModelFile, options: PlanOptions) -> PlanResult:
    try:
        check_objective(options.objective, options.deadline, options.budget)
    except ValueError as exc:
        raise CompileError(str(exc)) from exc
    if len(options.regions) > 1:
        return plan_regions(chain, model_file, options)
    region, problem = build_problem(chain, model_file, options, options.regions[0] if options.regions else None)
    # the baselines whatever their stage count (--stages fixes ours, not theirs); as incumbents, the
    # solver keeps those of the count asked for
    unfixed = dataclasses.replace(problem, min_stages=1)
    found = baselines(unfixed, options.objective, deadline=options.deadline, budget=options.budget)
    incumbents = tuple(b.plan for b in found if b.plan is not None)
    try:
        solution = solve(
            problem,
            options.objective,
            deadline=options.deadline,
            budget=options.budget,
            time_limit=options.time_limit,
            incumbents=incumbents,
        )
    except Infeasible as exc:
        raise PlanInfeasible(diagnose(problem, options, out_of_time=isinstance(exc, OutOfTime))) from exc
    length = run_length(model_file, problem.samples_per_epoch, problem.global_batch)
    return PlanResult(region, problem, solution, found, run_length=length)


def plan_regions(chain: BlockChain, model_file: ModelFile, options: PlanOptions) -> PlanResult:
    """Several regions: each region's frontier of pipeline plans, then the schedule between them.

    The regions share the partition and micro-batch size of the plan of the region holding the most
    data (their stages then map one to one for synchronisation); each region picks its own tiers
    and replicas from its frontier (its cheapest, its fastest, and a plan between)."""
    if model_file.load_shard is None:
        raise CompileError(
            f"{model_file.shown}: --regions needs load_shard(region, split) in the model file: it says how much "
            "training data lies in each region"
        )
    try:
        catalog = load_catalog(options.catalog)
        for name in options.regions:
            catalog.region(name)
    except SchemaError as exc:
        raise CompileError(str(exc)) from exc
    names = list(dict.fromkeys(options.regions))
    problems = {name: build_problem(chain, model_file, options, name) for name in names}
    data = {name: problems[name][1].samples_per_epoch or 0 for name in names}
    if not any(data.values()):
        raise CompileError(
            f"{model_file.shown}: load_shard(region, 'train') gives no samples in any of {', '.join(names)}"
        )
    # The run's length counts the data of every region (an epoch is a pass over all of it).
    length = run_length(model_file, sum(data.values()), problems[names[0]][1].global_batch)
    problems = {
        name: (region, dataclasses.replace(problem, iterations=length.iterations))
        for name, (region, problem) in problems.items()
    }
    main = max(names, key=lambda name: (data[name], -names.index(name)))
    in_place = frozenset(data_in_place(model_file, names))
    main_region, main_problem = problems[main]
    level1: Objective = "time" if options.objective.startswith("time") else "cost"
    found = baselines(main_problem, level1)
    try:
        partition_source = solve(
            main_problem, level1, time_limit=options.time_limit, incumbents=tuple(b.plan for b in found if b.plan)
        )
    except Infeasible as exc:
        raise PlanInfeasible(diagnose(main_problem, options, out_of_time=isinstance(exc, OutOfTime))) from exc
    ranges = [(c.first, c.last) for c in partition_source.plan.stages]
    mu = partition_source.plan.micro_batch
    sites: list[RegionSite] = []
    frontiers: list[list[Solution]] = []
    for name in names:
        region, problem = problems[name]
        problem = dataclasses.replace(problem, micro_batches=(mu,))
        problems[name] = (region, problem)
        frontier = region_frontier(problem, ranges, options.time_limit)
        if region.max_total_memory_mb is not None:
            frontier = within_memory(problem, ranges, frontier, region.max_total_memory_mb, options.time_limit)
        frontiers.append(frontier)
        prices = region.prices
        sites.append(
            RegionSite(
                name=name,
                data=data[name],
                options=tuple(_region_option(problem, sol) for sol in frontier),
                egress_usd_per_gb=prices.egress_per_gb,
                put_usd=prices.storage_put_per_1000 / 1000,
                get_usd=prices.storage_get_per_1000 / 1000,
                local=Link(region.bandwidth_bps(max(region.tiers_mb)), region.request_latency_s),
                may_move_to=_may_move_to(name, region.data_may_move_to, names, in_place),
                max_functions=region.max_functions,
                max_memory_mb=region.max_total_memory_mb,
            )
        )
    geo_problem = GeoProblem(
        sites=tuple(sites),
        links={frozenset((a, b)): catalog.link(a, b) for i, a in enumerate(names) for b in names[i + 1 :]},
        global_batch=main_problem.global_batch,
        iterations=main_problem.iterations,
        sync=options.sync,
        sync_every=options.sync_every,
        sample_bytes=main_problem.blocks[0].input_bytes / main_problem.profile_batch,
    )
    # The request's limits, the same for the schedule and for its baselines.
    solve_limited = functools.partial(
        solve_geo,
        geo_problem,
        options.objective,
        deadline=options.deadline,
        budget=options.budget,
        time_limit=options.time_limit,
    )
    try:
        solution = solve_limited()
    except GeoInfeasible as exc:
        raise PlanInfeasible(_diagnose_regions(geo_problem, options)) from exc
    geo_baselines = region_baselines(geo_problem, solve_limited)
    per_region: list[PlanResult | None] = []
    for r, name in enumerate(names):
        k = solution.plan.options[r]
        region, problem = problems[name]
        per_region.append(None if k is None else PlanResult(region, problem, frontiers[r][k]))
    chosen_main = per_region[names.index(main)]
    main_result = chosen_main or PlanResult(main_region, problems[main][1], partition_source)
    return PlanResult(
        main_result.region,
        main_result.problem,
        main_result.solution,
        found,
        GeoResult(geo_problem, solution, per_region, geo_baselines),
        run_length=length,
    )


def _may_move_to(
    name: str, residency: Sequence[str] | None, names: Sequence[str], in_place: frozenset[str]
) -> frozenset[str] | None:
    """Where a region's data may move: its residency, and never from or into a region whose data lies in
    place (its functions read their own region's shards where they lie; a move would be a staged copy)."""
    if name in in_place:
        return frozenset()
    if not in_place:
        return None if residency is None else frozenset(residency)
    return frozenset(residency if residency is not None else names) - in_place - {name}


def region_baselines(problem: GeoProblem, solve_limited: typing.Callable[..., GeoSolution]) -> list[GeoBaseline]:
    """The naive placements, each the same schedule's program restricted: data-local (every region trains
    what it holds), equal split (every region trains 1/n of the data, moved where residency allows) and
    each region alone (all data moved there, where residency allows); an infeasible one says why."""
    names = [s.name for s in problem.sites]
    # (name, description, keyword arguments of solve_geo, why it may be impossible)
    restrictions: list[tuple[str, str, dict[str, typing.Any], str]] = [
        ("data-local", "every region trains on the data it holds; nothing moves", {"allow_moves": False}, ""),
        (
            "equal-split",
            "every region trains an equal share of the data (moved where residency allows)",
            {"equal_split": True},
            _residency_blocks(problem, None),
        ),
    ]
    for r, name in enumerate(names):
        restrictions.append(
            (
                f"single-region:{name}",
                f"all data moved to {name}, trained there alone (FuncPipe)",
                {"only": [r]},
                _residency_blocks(problem, r),
            )
        )
    found: list[GeoBaseline] = []
    for label, description, kwargs, blocked in restrictions:
        try:
            found.append(GeoBaseline(label, description, solve_limited(**kwargs)))
        except GeoInfeasible:
            reason = blocked or "no schedule meets the request (capacity, deadline or budget) under this restriction"
            found.append(GeoBaseline(label, description, None, reason))
    return found


def _residency_blocks(problem: GeoProblem, target: int | None) -> str:
    """Why data residency rules out moving every region's data to `target` (None: moving data at all
    out of a region that must share it), or ''."""
    if target is None:
        kept = [s.name for s in problem.sites if s.data > 0 and s.may_move_to is not None and not s.may_move_to]
        return f"data residency: {', '.join(kept)} keeps its data" if kept else ""
    blocked = [
        s.name for a, s in enumerate(problem.sites) if a != target and s.data > 0 and not problem.may_move(a, target)
    ]
    if blocked:
        return (
            f"data residency: the data of {', '.join(blocked)} may not move to {problem.sites[target].name} "
            "(the catalog's data_may_move_to)"
        )
    return ""


def region_frontier(problem: Problem, ranges: list[tuple[int, int]], time_limit: float) -> list[Solution]:
    """A region's plans over a fixed partition: the cheapest, the fastest and one between (by a
    deadline at the geometric mean of their times), without the dominated ones."""
    found: list[Solution] = []
    try:
        cheapest = solve(problem, "cost", time_limit=time_limit, fixed_ranges=ranges)
        fastest = solve(problem, "time", time_limit=time_limit, fixed_ranges=ranges)
    except Infeasible:
        return []
    found = [cheapest, fastest]
    between = math.sqrt(cheapest.evaluation.iteration_s * fastest.evaluation.iteration_s) * problem.iterations
    try:
        found.append(
            solve(problem, "cost-under-deadline", deadline=between, time_limit=time_limit, fixed_ranges=ranges)
        )
    except Infeasible:
        pass
    frontier: list[Solution] = []
    for sol in sorted(found, key=lambda s: (s.evaluation.iteration_s, s.evaluation.cost_usd)):
        if any(s.plan == sol.plan for s in frontier):
            continue
        if frontier and sol.evaluation.cost_usd >= frontier[-1].evaluation.cost_usd:
            continue  # slower and no cheaper than one already kept
        frontier.append(sol)
    return frontier


def plan_memory_mb(plan: Plan) -> int:
    """The memory of a plan's concurrent functions together (every stage's tier times its replicas)."""
    return sum(c.tier_mb * c.replicas for c in plan.stages)


def within_memory(
    problem: Problem, ranges: list[tuple[int, int]], frontier: list[Solution], cap_mb: int, time_limit: float
) -> list[Solution]:
    """A region's frontier under its capacity `limits.max_total_memory_mb`: the plans within it and, when
    none is, the cheapest plan with ever fewer functions until one fits (none: the region cannot train)."""
    fitting = [s for s in frontier if plan_memory_mb(s.plan) <= cap_mb]
    if fitting:
        return fitting
    limit = cap_mb // min(problem.region.tiers_mb)
    while limit >= len(ranges):
        try:
            found = solve(
                dataclasses.replace(problem, max_functions=limit), "cost", time_limit=time_limit, fixed_ranges=ranges
            )
        except Infeasible:
            return []
        if plan_memory_mb(found.plan) <= cap_mb:
            return [found]
        limit = min(limit, sum(c.replicas for c in found.plan.stages)) - 1
    return []


def _region_option(problem: Problem, solution: Solution) -> RegionOption:
    evaluation = solution.evaluation
    return RegionOption(
        plan=solution.plan,
        iteration_s=evaluation.iteration_s,
        compute_usd=evaluation.compute_usd,
        fixed_usd=evaluation.request_usd + evaluation.storage_usd,
        largest_stage_bytes=max(t.parameter_bytes for t in evaluation.stages),
        stages=len(solution.plan.stages),
        functions=sum(c.replicas for c in solution.plan.stages),
        memory_mb=plan_memory_mb(solution.plan),
    )


def _diagnose_regions(problem: GeoProblem, options: PlanOptions) -> str:
    names = ", ".join(s.name for s in problem.sites)
    if not any(s.options for s in problem.sites):
        return f"no plan fits in any of {names} with the shared partition"
    for r, site in enumerate(problem.sites):
        stuck = site.data > 0 and not any(problem.may_move(r, b) for b in range(len(problem.sites)))
        if stuck and not any(site.fits(o) for o in site.options):
            return (
                f"{site.name}'s data may not leave it (the catalog's data_may_move_to), but no plan fits its capacity "
                f"(limits.max_functions {site.max_functions}, limits.max_total_memory_mb {site.max_memory_mb}): "
                "raise them or let its data move"
            )
        # each round a training region runs at least one iteration: data that stays is trained where it is
        share = problem.total_samples * site.data / problem.total_data / problem.global_batch
        if stuck and problem.sync != "sync" and share < problem.rounds:
            return (
                f"{site.name}'s data stays in it (data in place, or the catalog's data_may_move_to), and its share "
                f"of the training is {share:.3g} iterations, fewer than the {problem.rounds} rounds the regions meet "
                f"in (every {problem.sync_every} iterations): raise TRAINING's iterations or --sync-every"
            )
    try:
        fastest = solve_geo(problem, "time", time_limit=options.time_limit)
        cheapest = solve_geo(problem, "cost", time_limit=options.time_limit)
    except GeoInfeasible:
        return f"no schedule of {names} trains every region's data (its moves, capacity and rounds)"
    if options.deadline is not None and fastest.evaluation.training_s > options.deadline:
        return (
            f"no schedule of {names} meets the deadline: the fastest takes {fastest.evaluation.training_s:.1f} s, "
            f"above --deadline {options.deadline:g} s; raise it to at least "
            f"{math.ceil(fastest.evaluation.training_s)} s"
        )
    if options.budget is not None and cheapest.evaluation.cost_usd > options.budget:
        return (
            f"no schedule of {names} fits the budget: the cheapest costs {cheapest.evaluation.cost_usd:.4f} USD, "
            f"above --budget {options.budget:g} USD"
        )
    return f"no schedule of {names} meets both the deadline and the budget"


def diagnose(problem: Problem, options: PlanOptions, *, out_of_time: bool = False) -> str:
    """The tightest bound that makes the request infeasible, and what would lift it; `out_of_time`:
    the solver stopped at its time limit without a plan (then, if no bound proves none fits, says so)."""
    model = CostModel(problem)
    region = problem.region
    largest = max(region.tiers_mb)
    mu = min(problem.micro_batch_counts())
    most_replicas = max(problem.replicas)
    n = len(problem.blocks)
    # 1. All the model's state against every function the limit allows.
    state_mb = model.model_state_bytes(0, n - 1) / MB
    functions = problem.function_limit
    stages = min(problem.max_stages, n)
    capacity = min(functions, stages) * (largest - region.runtime_overhead_mb)
    if state_mb > capacity:
        return (
            f"no plan fits: the model's parameters, gradients and optimizer state need {state_mb / 1024:.1f} GB, "
            f"but {min(functions, stages)} functions of {largest} MB hold {capacity / 1024:.1f} GB after the "
            f"runtime's {region.runtime_overhead_mb:.0f} MB each; {problem.limits_hint()}, or use an optimizer "
            "with less state"
        )
    # 2. A block that fits no function even alone, with the most replicas, at the smallest micro-batch.
    n = len(problem.blocks)
    covered = {
        b
        for mu_ in problem.micro_batch_counts()
        for c, _, _ in stage_configs(problem, mu_)
        for b in range(c.first, c.last + 1)
    }
    for b in range(n):
        if b not in covered:
            terms = model.stage_terms(StageChoice(b, b, largest, most_replicas), min(b, 1), 3, mu)
            return (
                f"no plan fits: block {b} alone needs {terms.memory_mb:.0f} MB on the largest function "
                f"({largest} MB in {region.name}) at micro-batch {mu}; use a smaller micro-batch, more blocks "
                "(--blocks), the 1F1B schedule (--schedule 1f1b), or a region with larger functions"
            )
    # 3. The deadline against the fastest plan, the budget against the cheapest.
    if options.deadline is not None:
        try:
            fastest = solve(problem, "time", time_limit=options.time_limit)
            run_s = fastest.evaluation.iteration_s * problem.iterations
            if run_s > options.deadline:
                return (
                    f"no plan meets the deadline: the fastest plan takes {run_s:.1f} s for {problem.iterations} "
                    f"iterations ({fastest.evaluation.iteration_s:.2f} s each), "
                    f"above --deadline {options.deadline:g} s; "
                    f"raise the deadline to at least {math.ceil(run_s)} s or allow more functions"
                )
        except Infeasible:
            pass
    if options.budget is not None:
        try:
            cheapest = solve(problem, "cost", time_limit=options.time_limit)
            run_usd = cheapest.evaluation.cost_usd * problem.iterations
            if run_usd > options.budget:
                return (
                    f"no plan fits the budget: the cheapest plan costs {run_usd:.4f} USD for {problem.iterations} "
                    f"iterations, above --budget {options.budget:g} USD; raise the budget to at least "
                    f"{run_usd:.4f} USD"
                )
        except Infeasible:
            pass
    if out_of_time:
        return (
            f"the solver found no plan in {region.name} within its time limit ({options.time_limit:g} s), and none "
            "of the limits proves that none fits; give it longer with --solver-time-limit SECONDS"
        )
    within = f"{functions} function{'s' if functions > 1 else ''} and {stages} stage{'s' if stages > 1 else ''}"
    return f"no plan fits within {within} in {region.name}; {problem.limits_hint()}"
