"""The MILP's optimum equals exhaustive search on seeded random instances, for every objective."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from cloudless.compiler.errors import CompileError
from cloudless.compiler.planner import pipeline_milp as planner
from cloudless.compiler.planner import pipeline_program as program
from cloudless.compiler.planner.baselines import baselines, ratio, ratio_text
from cloudless.compiler.planner.cost_model import (
    CostModel,
    DataInPlace,
    OutOfRange,
    check_range,
    check_replicas,
    problem_from_chain,
)
from cloudless.compiler.planner.exhaustive import exhaustive
from cloudless.compiler.planner.pipeline_milp import solve
from cloudless.compiler.planner.pipeline_program import Infeasible
from cloudless.compiler.planner.solver import Program, solve_program
from cloudless.ir.catalog import load_catalog
from cloudless.ir.sample_order import HELD_SHARDS, STAGED_SHARD_BYTES, staged_shard_samples

from .planning_cases import random_problem

INSTANCES = 200
CHUNK = 20


def slow(*values: str) -> list:
    """Parameters that run in CI only (scripts/test.sh --all)."""
    return [pytest.param(v, marks=pytest.mark.slow) for v in values]


def primary(objective: str, evaluation) -> float:
    return evaluation.iteration_s if objective.startswith("time") else evaluation.cost_usd


def limits(seed: int, problem) -> dict[str, dict[str, float]]:
    """A deadline and a budget around the fastest and cheapest plans: some binding, some infeasible."""
    rng = random.Random(seed * 7 + 1)
    fastest = exhaustive(problem, "time")
    cheapest = exhaustive(problem, "cost")
    if fastest is None:
        return {"cost-under-deadline": {"deadline": 1.0}, "time-under-budget": {"budget": 1.0}}
    t_min = fastest[1].iteration_s * problem.iterations
    c_min = cheapest[1].cost_usd * problem.iterations
    return {
        "cost-under-deadline": {"deadline": t_min * rng.uniform(0.9, 2.0)},
        "time-under-budget": {"budget": c_min * rng.uniform(0.9, 2.0)},
    }


# One chunk runs in the fast suite; the rest (as thorough, slower to enumerate) in CI.
@pytest.mark.parametrize(
    "chunk", [pytest.param(c, marks=[pytest.mark.slow] if c != 2 else []) for c in range(INSTANCES // CHUNK)]
)
def test_milp_matches_exhaustive_search(chunk: int) -> None:
    checked = 0
    for seed in range(chunk * CHUNK, (chunk + 1) * CHUNK):
        problem = random_problem(seed)
        bounds = limits(seed, problem)
        for objective in ("cost", "time", "cost-under-deadline", "time-under-budget"):
            kwargs = bounds.get(objective, {})
            expected = exhaustive(problem, objective, **kwargs)
            try:
                got = solve(problem, objective, **kwargs)
            except Infeasible:
                got = None
            assert (expected is None) == (got is None), (seed, objective, expected, got)
            if got is None:
                continue
            want = primary(objective, expected[1])
            have = primary(objective, got.evaluation)
            assert have == pytest.approx(want, rel=1e-6), (seed, objective, expected[0], got.plan)
            # The MILP's own objective is the closed-form model's value of its plan.
            assert got.evaluation.feasible
            assert CostModel(problem).evaluate(got.plan) == got.evaluation
            assert got.gap <= 1e-6 and got.status == "optimal"
            checked += 1
    assert checked > CHUNK  # most instances are feasible for most objectives


@pytest.mark.parametrize("objective", [*slow("cost", "time", "cost-under-deadline"), "time-under-budget"])
def test_pruning_by_a_known_plan_keeps_the_optimum(objective: str) -> None:
    """With the baselines as incumbents, configurations that cannot beat them are dropped before the
    MILP; the optimum and its proof must survive, including when no configuration survives."""
    pruned = 0
    for seed in range(40):
        problem = random_problem(seed)
        kwargs = limits(seed, problem).get(objective, {})
        expected = exhaustive(problem, objective, **kwargs)
        incumbents = tuple(b.plan for b in baselines(problem, objective, **kwargs) if b.plan is not None)
        try:
            got = solve(problem, objective, incumbents=incumbents, **kwargs)
        except Infeasible:
            assert expected is None
            continue
        assert primary(objective, got.evaluation) == pytest.approx(primary(objective, expected[1]), rel=1e-6)
        assert got.gap <= 1e-6 and got.status == "optimal", (seed, got)
        pruned += "pruned" in got.candidates.values()
    assert pruned > 0


@pytest.mark.parametrize("objective", ["cost", *slow("time", "cost-under-deadline", "time-under-budget")])
def test_reduced_cost_fixing_keeps_the_optimum(objective: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Reduced-cost fixing (normally only on large programs) on every small one: the configurations it
    drops never hold a better plan, so the optimum and its proof survive; on some it drops some."""
    calls: list[tuple[int, int]] = []
    price = planner.price_configurations

    def recording(stage, initial, stop_at):
        pricing = price(stage, initial, stop_at)
        if pricing is not None:
            # A plan with c is worth at least the bound of all plans.
            assert (pricing.with_config >= pricing.bound - 1e-9 * abs(pricing.bound)).all()
            calls.append((len(stage.x), int((pricing.with_config > pricing.bound * (1 + 1e-9)).sum())))
        return pricing

    monkeypatch.setattr(planner, "PRICE_FROM_CONFIGS", 0)
    monkeypatch.setattr(planner, "price_configurations", recording)
    for seed in range(40):
        problem = random_problem(seed)
        kwargs = limits(seed, problem).get(objective, {})
        expected = exhaustive(problem, objective, **kwargs)
        incumbents = tuple(b.plan for b in baselines(problem, objective, **kwargs) if b.plan is not None)
        try:
            got = solve(problem, objective, incumbents=incumbents, **kwargs)
        except Infeasible:
            assert expected is None
            continue
        assert primary(objective, got.evaluation) == pytest.approx(primary(objective, expected[1]), rel=1e-6)
        assert got.gap <= 1e-6 and got.status == "optimal", (seed, got)
    assert len(calls) > 10 and any(raised for _, raised in calls)


def test_pricing_bound_is_the_lp_relaxation() -> None:
    """Column generation's Lagrangian bound equals the LP relaxation of the whole program, solved
    directly, and bounds every configuration's plans from below."""
    from bench.planner_bench import synthetic_chain

    problem = problem_from_chain(
        synthetic_chain(10), load_catalog().regions[0], global_batch=64, micro_batches=(4,), optimizer_state=2
    )
    configs = program.stage_configs(problem, 4)
    table, floors = program.prune(
        problem, "cost", program.ConfigTable(problem, 4, configs), deadline=None, budget=None, cutoff=None
    )
    found = program.heuristic_plan(problem, "cost", 4, table, None, None)
    cutoff = found[1]
    table, floors = program.prune(problem, "cost", table, deadline=None, budget=None, cutoff=cutoff)
    stage = program.build_program(problem, "cost", 4, table, floors, deadline=None, budget=None, cutoff=cutoff)
    pricing = planner.price_configurations(stage, program._indices(table, found[0].plan), math.inf)
    assert pricing is not None and pricing.rounds > 1

    relaxed = stage.program
    relaxed.integer = []
    outcome = solve_program(relaxed, None)
    assert outcome.status == "optimal"
    assert pricing.bound == pytest.approx(outcome.bound, rel=1e-7)
    # The heuristic's plan is one of the plans: its cost (program units) is above its stages' bounds.
    value = cutoff * stage.scale
    for i in program._indices(table, found[0].plan):
        assert pricing.with_config[i] <= value * (1 + 1e-7)


@pytest.mark.parametrize("objective", ["cost", *slow("time", "cost-under-deadline", "time-under-budget")])
def test_cbc_finds_the_optimum_highs_and_exhaustive_search_find(objective: str) -> None:
    """The adapter's CBC path (used when highspy is missing) solves the pipeline programs to the
    same optimum as HiGHS, in the same status vocabulary, and its plan is the exhaustive optimum."""
    solved = 0
    for seed in range(10):
        problem = random_problem(seed)
        kwargs = limits(seed, problem).get(objective, {})
        bounds = {"deadline": None, "budget": None, **kwargs}
        for mu in sorted(problem.micro_batch_counts()):
            configs = program.stage_configs(problem, mu)
            table, floors = program.prune(
                problem, objective, program.ConfigTable(problem, mu, configs), cutoff=None, **bounds
            )
            if not len(table):
                continue
            stage = program.build_program(problem, objective, mu, table, floors, cutoff=None, **bounds)
            highs = solve_program(stage.program, None, backend="HiGHS")
            cbc = solve_program(stage.program, None, backend="CBC")
            assert (highs.solver, cbc.solver) == ("HiGHS", "CBC")
            assert cbc.status == highs.status, (seed, mu, highs, cbc)
            if cbc.status != "optimal":
                assert cbc.values is None and cbc.bound == math.inf
                continue
            assert cbc.bound == pytest.approx(highs.bound, rel=1e-6), (seed, mu)
            assert cbc.values is not None
            chosen = sorted(
                (table.configs[i][0] for i in range(len(table)) if cbc.values[stage.x[i]] > 0.5), key=lambda c: c.first
            )
            evaluation = CostModel(problem).evaluate(program.Plan(mu, tuple(chosen)))
            expected = exhaustive(dataclasses.replace(problem, micro_batches=(mu,)), objective, **kwargs)
            assert expected is not None
            assert primary(objective, evaluation) == pytest.approx(primary(objective, expected[1]), rel=1e-6)
            solved += 1
    assert solved > 5


@pytest.mark.parametrize("backend", ["HiGHS", "CBC"])
def test_solver_statuses(backend: str) -> None:
    """One vocabulary from either backend: "optimal" with the optimum as the bound, "infeasible"
    with an infinite bound (also for a row without columns that cannot hold)."""
    program = Program()
    x = program.column(0.0, 3.0, integer=True)
    y = program.column(0.0, 10.0)
    program.row([(x, 1.0), (y, 1.0)], lower=2.5)
    program.cost[x], program.cost[y] = 1.0, 1.5
    outcome = solve_program(program, None, backend=backend)
    assert (outcome.status, outcome.solver) == ("optimal", backend)
    assert outcome.bound == pytest.approx(2.75) and outcome.values is not None
    assert outcome.values[x] == pytest.approx(2.0) and outcome.values[y] == pytest.approx(0.5)

    program.row([(x, 1.0)], upper=1.0)
    program.row([(y, 1.0)], upper=1.0)
    outcome = solve_program(program, None, backend=backend)
    assert (outcome.status, outcome.values, outcome.bound) == ("infeasible", None, math.inf)

    empty = Program()
    empty.column()
    empty.row([], 1.0, 1.0)  # e.g. data held by a region that may neither train nor send it
    assert solve_program(empty, None, backend=backend).status == "infeasible"


def test_model_state_is_one_formula() -> None:
    """Parameters, gradients, optimizer state and buffers: what a stage holds besides activations and
    boundary tensors, and what diagnose compares with all functions' memory."""
    for seed in range(20):
        problem = random_problem(seed)
        model = CostModel(problem)
        n = len(problem.blocks)
        params = sum(b.param_bytes for b in problem.blocks) + sum(problem.shared_bytes.values())
        buffers = sum(b.buffer_bytes for b in problem.blocks)
        assert model.model_state_bytes(0, n - 1) == (2 + problem.optimizer_state) * params + buffers
        mu = min(problem.micro_batch_counts())
        terms = model.stage_terms(program.StageChoice(0, n - 1, max(problem.region.tiers_mb), 1), 0, 1, mu)
        activations = mu / problem.profile_batch * sum(b.saved_bytes for b in problem.blocks)
        inputs = mu / problem.profile_batch * problem.blocks[0].input_bytes
        held = problem.global_batch // mu if problem.schedule == "gpipe" else 1
        expected = model.model_state_bytes(0, n - 1) + activations * held + 2 * inputs + model.first_stage_held_bytes()
        assert (terms.memory_mb - problem.region.runtime_overhead_mb) * 2**20 == pytest.approx(expected, rel=1e-12)


def test_a_first_stage_holds_a_group_of_staged_shards_and_one_more_or_the_whole_split() -> None:
    """Staged data is read as data in place is: its cache holds SHUFFLE_SHARDS + 1 shards of the sample's
    bytes and reads one (HELD_SHARDS of them in all), about 16 MB a shard at most, or the whole split when it is
    smaller; each shard a request."""
    problem = random_problem(0)
    sample = problem.blocks[0].input_bytes / problem.profile_batch
    shard = staged_shard_samples(math.ceil(sample))
    unsized = CostModel(dataclasses.replace(problem, samples_per_epoch=None))
    assert unsized.first_stage_held_bytes() == pytest.approx(HELD_SHARDS * shard * sample)
    small = CostModel(dataclasses.replace(problem, samples_per_epoch=3))  # fewer samples than a shard holds
    assert shard > 3 and small.first_stage_held_bytes() == pytest.approx(3 * sample)
    assert unsized.first_stage_held_bytes() <= HELD_SHARDS * max(STAGED_SHARD_BYTES, sample) + 1
    mu, bandwidth = 8, 50e6
    assert unsized.first_stage_read_s(mu, mu * sample, bandwidth) == pytest.approx(
        mu * sample / bandwidth + unsized.latency * mu / shard
    )


def test_data_in_place_is_held_and_read_by_the_first_stage_alone() -> None:
    """The shards a first stage's cache holds are its memory, and the stored bytes of a micro-batch's samples
    (a shard's GET shared by its samples) its download; a later stage holds and reads none of them. With no
    counts (sizes alone), the micro-batch's tensors stand in for the bytes read."""
    checked = 0
    for seed in range(10):
        problem = random_problem(seed)
        held = 300 * 2**20
        data = CostModel(dataclasses.replace(problem, data=DataInPlace(held, 5_000.0, 100.0)))
        sized = CostModel(dataclasses.replace(problem, data=DataInPlace(held)))
        staged = CostModel(problem)
        n, mu = len(problem.blocks), min(problem.micro_batch_counts())
        if n < 2:
            continue
        checked += 1
        tier = max(problem.region.tiers_mb)
        for index, choice in ((0, program.StageChoice(0, 0, tier, 1)), (1, program.StageChoice(1, n - 1, tier, 1))):
            ours, theirs = data.stage_terms(choice, index, 2, mu), staged.stage_terms(choice, index, 2, mu)
            staged_held = staged.first_stage_held_bytes() / 2**20  # staged shards: a cache of its own
            assert ours.memory_mb - theirs.memory_mb == pytest.approx(300.0 - staged_held if index == 0 else 0.0)
            if index == 0:
                bandwidth = data._tier_rates(tier)[1]
                assert ours.forward_download_s == pytest.approx(mu * (5_000 / bandwidth + data.latency / 100))
                assert sized.stage_terms(choice, 0, 2, mu).forward_download_s == theirs.forward_download_s
            else:
                assert ours.forward_download_s == theirs.forward_download_s
    assert checked >= 5


# --- figures at the edges: zero prices, extreme catalogs ---------------------------------------------


def with_prices(problem, **prices):
    region = problem.region
    return dataclasses.replace(
        problem, region=dataclasses.replace(region, prices=dataclasses.replace(region.prices, **prices))
    )


FREE = {
    "gb_second": 0.0,
    "per_million_requests": 0.0,
    "storage_put_per_1000": 0.0,
    "storage_get_per_1000": 0.0,
    "egress_per_gb": 0.0,
}


@pytest.mark.parametrize(
    ("objective", "limits"),
    [("cost", {}), ("time", {}), ("time-under-budget", {"budget": 1.0}), ("cost-under-deadline", {"deadline": 1e6})],
)
@pytest.mark.parametrize(
    "prices", [FREE, {"gb_second": 0.0}, {"per_million_requests": 0.0, "storage_put_per_1000": 0.0}]
)
def test_zero_prices_plan_and_their_ratios_are_none(objective: str, limits: dict, prices: dict) -> None:
    """A free platform (every price, or one, zero) plans like any other; a baseline whose cost is zero
    has no cost ratio (None: plan.json's null, the report's n/a), never a division by zero."""
    for seed in range(6):
        problem = with_prices(random_problem(seed), **prices)
        try:
            solution = solve(problem, objective, time_limit=None, **limits)
        except Infeasible:
            continue
        assert math.isfinite(solution.evaluation.cost_usd) and math.isfinite(solution.gap)
        for baseline in baselines(problem, objective, **limits):
            if baseline.evaluation is None:
                continue
            time_ratio, cost_ratio = baseline.ratios(solution.evaluation)
            assert time_ratio is None or math.isfinite(time_ratio)
            if baseline.evaluation.cost_usd == 0:
                assert cost_ratio is None
            else:
                assert cost_ratio == solution.evaluation.cost_usd / baseline.evaluation.cost_usd


def test_ratio_is_none_without_a_finite_quotient() -> None:
    assert ratio(1.0, 2.0) == 0.5 and ratio(0.0, 2.0) == 0.0
    for ours, theirs in [(1.0, 0.0), (0.0, 0.0), (math.inf, 1.0), (1.0, math.inf), (math.nan, 1.0), (1e300, 1e-300)]:
        assert ratio(ours, theirs) is None, (ours, theirs)
    assert ratio_text(None) == "n/a" and ratio_text(0.5) == "0.50x"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"min_mb_per_s": 1e-300, "max_mb_per_s": 1e-300}, r"its figures make one iteration take .* s even as one"),
        ({"request_latency_s": 1e300}, r"its figures make one iteration take .* s"),
        ({"max_vcpus": 1e-300}, r"its figures make one iteration take .* s"),
        ({"memory_gbps_per_vcpu": 1e-300}, r"its figures make one iteration take .* s"),
        ({"gflops_per_vcpu": 1e-300}, r"its figures make one iteration take .* s"),
        ("prices", r"its prices make one iteration cost .* USD even as one function .* check the region's prices"),
    ],
)
def test_a_region_out_of_any_range_is_one_clear_error(change, message: str) -> None:
    """Figures that put even the simplest plan beyond MAX_ITERATION_S or MAX_ITERATION_USD (or to infinity)
    are refused naming the region, before the MILP is given coefficients it cannot weigh."""
    problem = random_problem(3)
    check_range(problem)  # the seeded problem itself is in range
    if change == "prices":
        bad = with_prices(problem, gb_second=1e300, per_million_requests=1e300)
    else:
        bad = dataclasses.replace(problem, region=dataclasses.replace(problem.region, **change))
    with pytest.raises(OutOfRange, match=f"catalog region {problem.region.name}: {message}"):
        check_range(bad)


def test_extreme_but_finite_figures_plan() -> None:
    """Tiny prices and huge bandwidths are no error: the plan's figures stay finite."""
    for change in ({"min_mb_per_s": 1e300, "max_mb_per_s": 1e300}, {"gflops_per_vcpu": 1e300}):
        problem = random_problem(3)
        problem = dataclasses.replace(problem, region=dataclasses.replace(problem.region, **change))
        check_range(problem)
        for objective in ("cost", "time"):
            solution = solve(problem, objective, time_limit=None)
            assert math.isfinite(solution.evaluation.iteration_s) and math.isfinite(solution.evaluation.cost_usd)
    problem = with_prices(random_problem(3), **dict.fromkeys(FREE, 1e-300))
    check_range(problem)
    assert math.isfinite(solve(problem, "cost", time_limit=None).evaluation.cost_usd)


def test_a_solver_answer_that_is_no_chain_of_stages_is_no_plan() -> None:
    """HiGHS in numerical trouble may set no configuration (or overlapping ones): that is no plan."""
    choice = program.StageChoice
    assert program._tiles([choice(0, 1, 1024, 1), choice(2, 2, 1024, 1)], 3)
    assert not program._tiles([], 3)
    assert not program._tiles([choice(0, 1, 1024, 1)], 3)
    assert not program._tiles([choice(0, 1, 1024, 1), choice(1, 2, 1024, 1)], 3)
    assert not program._tiles([choice(0, 0, 1024, 1), choice(2, 2, 1024, 1)], 3)


def test_a_region_frontier_keeps_within_its_total_memory() -> None:
    """limits.max_total_memory_mb (a region's capacity): the frontier keeps the plans within it, and
    when none is, finds the cheapest plan with fewer functions that fits (or none: the region cannot
    train)."""
    from cloudless.compiler.planner.plan import plan_memory_mb, region_frontier, within_memory

    checked = 0
    for seed in range(12):
        problem = dataclasses.replace(random_problem(seed), replicas=(1, 2, 4), max_functions=None)
        ranges = [(0, len(problem.blocks) - 1)]
        frontier = region_frontier(problem, ranges, 5.0)
        if not frontier:
            continue
        most = max(plan_memory_mb(s.plan) for s in frontier)
        least = min(plan_memory_mb(s.plan) for s in frontier)
        assert within_memory(problem, ranges, frontier, most, 5.0) == frontier
        cap = least - 1
        assert all(plan_memory_mb(s.plan) <= cap for s in within_memory(problem, ranges, frontier, cap, 5.0))
        # the largest plan alone over a cap only a smaller one meets: the fallback finds one that fits
        largest = max(frontier, key=lambda s: plan_memory_mb(s.plan))
        if plan_memory_mb(largest.plan) > least:
            kept = within_memory(problem, ranges, [largest], least, 5.0)
            assert kept and all(plan_memory_mb(s.plan) <= least for s in kept)
            checked += 1
    assert checked >= 1


@pytest.mark.parametrize("objective", ["cost", "time"])
def test_a_fixed_stage_count_is_the_optimum_over_plans_of_that_many_stages(objective: str) -> None:
    """--stages N: min_stages = max_stages = N; the baselines (of any count) stay incumbents, as the
    plan pass gives them, and only plans of N stages may win."""
    checked = 0
    for seed in range(20):
        base = random_problem(seed)
        stages = min(2 + seed % 2, len(base.blocks))
        problem = dataclasses.replace(base, min_stages=stages, max_stages=stages)
        expected = exhaustive(problem, objective)
        incumbents = tuple(b.plan for b in baselines(base, objective) if b.plan is not None)
        try:
            got = solve(problem, objective, incumbents=incumbents)
        except Infeasible:
            assert expected is None, seed
            continue
        assert expected is not None and len(got.plan.stages) == stages == len(expected[0].stages), seed
        assert primary(objective, got.evaluation) == pytest.approx(primary(objective, expected[1]), rel=1e-6)
        checked += 1
    assert checked > 10


def test_with_a_fixed_stage_count_the_heuristic_starts_from_a_plan_of_that_many_stages() -> None:
    """--stages N on a chain the MILP cannot finish in its time: the heuristic's incumbent is a plan of
    N stages (a path of any length would be none), so the planner answers with one rather than "no
    plan fits"."""
    from cloudless.compiler.planner.pipeline_program import ConfigTable, heuristic_plan, stage_configs

    checked = 0
    for seed in range(20):
        base = random_problem(seed)
        free = exhaustive(base, "cost")
        if free is None or len(free[0].stages) >= len(base.blocks):
            continue
        stages = len(free[0].stages) + 1  # more than the cheapest plan has: its path is not one
        problem = dataclasses.replace(base, min_stages=stages, max_stages=stages)
        expected = exhaustive(problem, "cost")
        if expected is None:
            continue
        mu = expected[0].micro_batch
        table = ConfigTable(problem, mu, stage_configs(problem, mu))
        found = heuristic_plan(problem, "cost", mu, table, None, None)
        assert found is not None and len(found[0].plan.stages) == stages, seed
        checked += 1
    assert checked >= 5


def test_a_solver_out_of_time_without_a_plan_is_told_so_not_that_no_plan_fits() -> None:
    from cloudless.compiler.planner.plan import PlanOptions, diagnose

    problem = next(p for seed in range(20) if exhaustive(p := random_problem(seed), "cost") is not None)
    told = diagnose(problem, PlanOptions(time_limit=2.0), out_of_time=True)
    assert "no plan in" in told and "time limit (2 s)" in told and "--solver-time-limit" in told
    assert "no plan fits within" in diagnose(problem, PlanOptions(time_limit=2.0))


def test_a_block_whose_buffer_changes_in_sequence_gets_one_replica_and_the_optimum_of_the_rest() -> None:
    """BlockCost.sequenced (a buffer the forward changes in an order replicas cannot reproduce): the stage
    holding it runs one replica, in the solver's plan as in exhaustive search, baselines competing."""
    checked = 0
    for seed in range(40):
        base = dataclasses.replace(random_problem(seed), replicas=(1, 2, 4), max_functions=None)
        free = exhaustive(base, "time")
        if free is None:
            continue
        crowded = [s for s in free[0].stages if s.replicas > 1]
        if not crowded:
            continue
        held = crowded[0].first
        blocks = list(base.blocks)
        blocks[held] = dataclasses.replace(blocks[held], sequenced=("ema",))
        problem = dataclasses.replace(base, blocks=tuple(blocks))
        expected = exhaustive(problem, "time")
        if expected is None:  # it fits only under replicas (each holding fewer micro-batches' activations)
            continue
        incumbents = tuple(b.plan for b in baselines(problem, "time") if b.plan is not None)
        got = solve(problem, "time", incumbents=incumbents)
        for plan in (expected[0], got.plan):
            assert all(s.replicas == 1 for s in plan.stages if s.first <= held <= s.last), (seed, plan)
        assert got.evaluation.iteration_s == pytest.approx(expected[1].iteration_s, rel=1e-6), seed
        checked += 1
    assert checked >= 3
    with pytest.raises(CompileError, match="changes buffer ema in place.*include 1"):
        check_replicas(dataclasses.replace(problem, replicas=(2, 4)))
