"""The MILP's optimum equals exhaustive search on seeded random instances, for every objective."""

from __future__ import annotations

import random

import pytest

from cloudless.compiler.baselines import baselines
from cloudless.compiler.cost_model import CostModel
from cloudless.compiler.exhaustive import exhaustive
from cloudless.compiler.planner import Infeasible, solve

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
