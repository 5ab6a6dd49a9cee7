"""The MILP's optimum equals exhaustive search on seeded random instances, for every objective."""

from __future__ import annotations

import math
import random

import pytest

from cloudless.compiler import planner
from cloudless.compiler.baselines import baselines
from cloudless.compiler.cost_model import CostModel, problem_from_chain
from cloudless.compiler.exhaustive import exhaustive
from cloudless.compiler.planner import Infeasible, solve
from cloudless.ir.catalog import load_catalog

from .planning_cases import random_problem

INSTANCES = 200
CHUNK = 20


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


@pytest.mark.parametrize("chunk", range(INSTANCES // CHUNK))
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


@pytest.mark.parametrize("objective", ["cost", "time", "cost-under-deadline", "time-under-budget"])
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


@pytest.mark.parametrize("objective", ["cost", "time", "cost-under-deadline", "time-under-budget"])
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
    configs = planner.stage_configs(problem, 4)
    table, floors = planner.prune(
        problem, "cost", planner.ConfigTable(problem, 4, configs), deadline=None, budget=None, cutoff=None
    )
    found = planner.heuristic_plan(problem, "cost", 4, table, None, None)
    cutoff = found[1]
    table, floors = planner.prune(problem, "cost", table, deadline=None, budget=None, cutoff=cutoff)
    stage = planner.build_program(problem, "cost", 4, table, floors, deadline=None, budget=None, cutoff=cutoff)
    pricing = planner.price_configurations(stage, planner._indices(table, found[0].plan), math.inf)
    assert pricing is not None and pricing.rounds > 1

    relaxed = stage.program
    relaxed.integer = []
    outcome = planner.run_program(relaxed, None)
    assert outcome.status == "optimal"
    assert pricing.bound == pytest.approx(outcome.bound, rel=1e-7)
    # The heuristic's plan is one of the plans: its cost (program units) is above its stages' bounds.
    value = cutoff * stage.scale
    for i in planner._indices(table, found[0].plan):
        assert pricing.with_config[i] <= value * (1 + 1e-7)
