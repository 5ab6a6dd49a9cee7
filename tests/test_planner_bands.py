"""The search by bands of the bottleneck (planner_bands), which large programs take: its optimum is the
exhaustive one, its floors hold for every plan of a band, and it never returns worse than it was given."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import random
from pathlib import Path

import numpy as np
import pytest

from cloudless.compiler.planner import bands as planner_bands
from cloudless.compiler.planner import pipeline_milp as planner
from cloudless.compiler.planner import pipeline_program as program
from cloudless.compiler.planner.baselines import baselines
from cloudless.compiler.planner.cost_model import BlockCost, CostModel, Plan, Problem, StageChoice, problem_from_chain
from cloudless.compiler.planner.exhaustive import contiguous_ranges, exhaustive
from cloudless.compiler.planner.pipeline_milp import solve
from cloudless.compiler.planner.pipeline_program import ConfigTable, Infeasible
from cloudless.ir import BlockChain
from cloudless.ir.catalog import load_catalog

from .planning_cases import random_problem
from .test_planner import limits, primary, slow

PROFILES = Path(__file__).parent / "profiles"
OBJECTIVES = ("cost", "time", "cost-under-deadline", "time-under-budget")


@pytest.fixture
def every_program_by_bands(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every program searched by bands, split down to a few configurations each (so that splitting,
    reduced-cost fixing and the MILPs of bands all run on small problems); records the bands examined."""
    examined: list[int] = []
    search = planner_bands.search_bands

    def recording(*args, **kwargs):
        found = search(*args, **kwargs)
        examined.append(found.bands)
        return found

    monkeypatch.setattr(planner, "BAND_FROM_CONFIGS", 0)
    monkeypatch.setattr(planner, "search_bands", recording)  # as solve_for_micro_batch calls it
    monkeypatch.setattr(planner_bands, "MILP_CONFIGS", 3)
    monkeypatch.setattr(planner_bands, "FEW_CONFIGS", 1)
    return examined


@pytest.mark.slow
@pytest.mark.parametrize("objective", ["cost", "time-under-budget", *slow("time", "cost-under-deadline")])
def test_bands_find_the_exhaustive_optimum(objective: str, every_program_by_bands: list[int]) -> None:
    """With and without the baselines as incumbents, the optimum and its proof, as exhaustive search."""
    checked = 0
    for seed in range(40):
        problem = random_problem(seed)
        kwargs = limits(seed, problem).get(objective, {})
        expected = exhaustive(problem, objective, **kwargs)
        incumbents = tuple(b.plan for b in baselines(problem, objective, **kwargs) if b.plan is not None)
        for given in ((), incumbents):
            try:
                got = solve(problem, objective, incumbents=given, **kwargs)
            except Infeasible:
                assert expected is None, seed
                continue
            assert expected is not None, seed
            assert primary(objective, got.evaluation) == pytest.approx(primary(objective, expected[1]), rel=1e-6), seed
            assert got.gap <= 1e-6 and got.status == "optimal", (seed, got)
            assert got.evaluation.feasible
            checked += 1
    assert checked > 20
    assert max(every_program_by_bands) > 3  # some programs were split into bands


def test_bands_on_the_benchmark_chain_match_the_whole_program() -> None:
    """The benchmark's chain (jittered BERT-like layers) and the same of identical layers: the bands'
    optimum is the one MILP's, proven."""
    from bench.planner_bench import synthetic_chain

    region = load_catalog().regions[0]
    for identical in (False, True):
        chain = synthetic_chain(12, identical=identical)
        problem = problem_from_chain(chain, region, global_batch=64, micro_batches=(4,), optimizer_state=2)
        for objective in ("cost", "time"):
            original = planner.BAND_FROM_CONFIGS
            try:
                planner.BAND_FROM_CONFIGS = 10**12  # one MILP, whatever its size
                whole = planner.solve_for_micro_batch(problem, objective, 4, time_limit=None)
                planner.BAND_FROM_CONFIGS = 0
                banded = planner.solve_for_micro_batch(problem, objective, 4, time_limit=None)
            finally:
                planner.BAND_FROM_CONFIGS = original
            assert whole[0] is not None and banded[0] is not None
            assert banded[0].objective_value == pytest.approx(whole[0].objective_value, rel=1e-7)
            assert (whole[2], banded[2]) == ("optimal", "optimal")


def plans_of(problem, mu: int):
    """Every plan of micro-batch size mu."""
    options = [(m, r) for m in problem.region.tiers_mb for r in problem.replicas]
    for stages in range(1, min(problem.max_stages, len(problem.blocks)) + 1):
        for ranges in contiguous_ranges(len(problem.blocks), stages):
            for picks in itertools.product(options, repeat=len(ranges)):
                yield Plan(mu, tuple(StageChoice(a, b, m, r) for (a, b), (m, r) in zip(ranges, picks, strict=True)))


def test_band_floors_hold_for_every_plan_of_the_band() -> None:
    """ConfigTable.band's floor of the iteration time and product_floors' of the cost are below the time
    and cost of every plan of the band that holds the configuration."""
    rng = random.Random(5)
    checked = 0
    for seed in range(30):
        problem = random_problem(seed)
        if problem.region.prices.gb_second <= 0:
            continue
        model = CostModel(problem)
        mu = min(problem.micro_batch_counts())
        table = ConfigTable(problem, mu, program.stage_configs(problem, mu))
        if not len(table):
            continue
        levels = sorted(set(table.steady.tolist()))
        above = rng.choice([-math.inf, *levels[:-1]])
        most = rng.choice([level for level in levels if level > above])
        band = table.band(above, most)
        floors = planner_bands.product_floors(band)
        where = {config[0]: i for i, config in enumerate(band.configs)}
        for plan in plans_of(problem, mu):
            if not all(c in where for c in plan.stages):
                continue
            index = [where[c] for c in plan.stages]
            sigma = max(band.steady[i] for i in index)
            if not above < sigma <= most:
                continue
            evaluation = model.evaluate(plan)
            for i in index:
                assert band.low[i] <= evaluation.iteration_s * (1 + 1e-9), (seed, plan)
                assert floors[i] <= evaluation.cost_usd * (1 + 1e-9), (seed, plan)
            checked += 1
    assert checked > 100


def test_a_search_out_of_time_keeps_its_incumbent_and_a_valid_bound() -> None:
    """Stopped before it starts, the search returns the plan it was given (never a worse one) and a bound
    below the optimum; given all the time, a plan at least as good, proven optimal."""
    from bench.planner_bench import synthetic_chain

    region = load_catalog().regions[0]
    problem = problem_from_chain(
        synthetic_chain(10), region, global_batch=64, micro_batches=(4,), optimizer_state=2, max_stages=4
    )
    table = ConfigTable(problem, 4, program.stage_configs(problem, 4))
    found = program.heuristic_plan(problem, "cost", 4, table, None, None)
    assert found is not None
    # The optimum as one MILP finds it (small programs are solved so, against exhaustive search above).
    optimum = planner.solve_for_micro_batch(problem, "cost", 4, time_limit=None)[0]
    assert optimum is not None and optimum.status == "optimal"
    kwargs = {"deadline": None, "budget": None}
    stopped = planner_bands.search_bands(problem, "cost", 4, table, found[0], found[1], stop_at=0.0, **kwargs)
    assert stopped.status == "time limit" and stopped.solution is found[0]
    assert stopped.bound <= optimum.objective_value * (1 + 1e-9)
    done = planner_bands.search_bands(problem, "cost", 4, table, found[0], found[1], stop_at=math.inf, **kwargs)
    assert done.status == "optimal" and done.solution is not None
    assert done.solution.objective_value <= found[1]
    assert done.solution.objective_value == pytest.approx(optimum.objective_value, rel=1e-6)
    assert done.bound == pytest.approx(done.solution.objective_value, rel=1e-6)


def replicated_llama_problem() -> Problem:
    """Four blocks of a Llama-3-8B layer's size (0.87 GB of parameters each, SGD) in 64 micro-batches:
    a stage fast enough for a small steady term is replicated, and its gradient sync (its tail) takes
    tens of seconds, more than the band's floor of the time counts."""
    block = BlockCost(
        forward_s=0.48,
        backward_s=0.82,
        param_bytes=872_448_000,
        buffer_bytes=0,
        saved_bytes=50_414_592,
        input_bytes=2_097_152,
        output_bytes=2_097_152,
    )
    region = dataclasses.replace(load_catalog().regions[0], tiers_mb=(4096, 7168, 10240))
    return Problem(
        blocks=(block,) * 4,
        shared_bytes={},
        profile_batch=1,
        reference_gflops=150.0,
        threads=2,
        region=region,
        global_batch=64,
        micro_batches=(1,),
        replicas=(1, 2, 4),
        max_stages=4,
        max_functions=None,
        schedule="gpipe",
        optimizer_state=0,
        iterations=100,
    )


def test_tail_floors_hold_and_count_the_syncs_of_replicated_stages() -> None:
    """In every band of the steady term, product_floors (with tail_floors) is below the cost of every
    plan of the band holding the configuration; in the band of the optimum it is within 2 % of the
    optimum (24 % below before the tails counted: the fills and the band's bottom alone)."""
    problem = replicated_llama_problem()
    model = CostModel(problem)
    table = ConfigTable(problem, 1, program.stage_configs(problem, 1))
    where = {config[0]: i for i, config in enumerate(table.configs)}
    plans = []
    for plan in plans_of(problem, 1):
        evaluation = model.evaluate(plan)
        if evaluation.feasible:
            index = [where[c] for c in plan.stages]
            plans.append((index, max(table.steady[i] for i in index), evaluation.cost_usd))
    optimum = min(plans, key=lambda found: found[2])
    levels = sorted(set(table.steady.tolist()))
    checked = 0
    for above, most in zip([-math.inf, *levels[:-1]], levels, strict=True):
        band = table.band(above, most)
        floors = planner_bands.product_floors(band)
        inside = {config[0]: i for i, config in enumerate(band.configs)}
        for index, sigma, cost in plans:
            if above < sigma <= most:
                for i in index:
                    assert floors[inside[table.configs[i][0]]] <= cost * (1 + 1e-9), (above, most, index)
                checked += 1
        if above < optimum[1] <= most:
            assert floors.min() >= 0.98 * optimum[2], (above, most, floors.min(), optimum[2])
    assert checked == len(plans) > 1000


def test_the_8b_shapes_plan_is_proven_in_few_bands(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 4-layer Llama-3-8B shape's profile (tests/profiles, 30 blocks, as its plan-only compile wrote
    it): the band search proves its plan optimal in at most 150 bands (418 before tail_floors: a floor
    of the cost that did not see the replicated stages' gradient syncs left the bands of a small steady
    term to be searched one by one)."""
    chain = BlockChain.from_json(json.loads((PROFILES / "llama3_8b_4_layers.blocks.json").read_text()))
    problem = problem_from_chain(
        chain,
        load_catalog().regions[0],
        global_batch=64,
        micro_batches=(1,),
        optimizer_state=0,
        replicas=(1, 2, 4),
        max_stages=15,
        iterations=100,
    )
    examined: list[int] = []
    search = planner_bands.search_bands

    def recording(*args, **kwargs):
        found = search(*args, **kwargs)
        examined.append(found.bands)
        return found

    monkeypatch.setattr(planner, "search_bands", recording)  # as solve_for_micro_batch calls it
    incumbents = tuple(b.plan for b in baselines(problem, "cost") if b.plan is not None)
    solution = solve(problem, "cost", time_limit=None, incumbents=incumbents)
    assert solution.status == "optimal" and solution.gap == 0.0
    assert len(examined) == 1 and examined[0] <= 150, examined


def test_least_paths_of_rows_is_least_paths_of_each_row() -> None:
    """The stacked shortest paths tail_floors takes (one row per level) are those of each row alone,
    with configurations left out (infinite weights) and both directions."""
    problem = replicated_llama_problem()
    table = ConfigTable(problem, 1, program.stage_configs(problem, 1))
    rng = random.Random(3)
    rows = [[rng.uniform(0.0, 5.0) if rng.random() < 0.8 else math.inf for _ in range(len(table))] for _ in range(4)]
    weights = np.array(rows)
    for forward in (True, False):
        stacked = table.least_paths_of_rows(weights, forward)
        for row, found in zip(weights, stacked, strict=True):
            assert np.array_equal(found, table.least_paths(row, forward))
