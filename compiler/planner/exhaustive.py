"""Exhaustive search over every plan of a small problem: the ground truth the MILP is checked against."""

from __future__ import annotations

import itertools
from collections.abc import Iterable

from .cost_model import CostModel, Evaluation, Objective, Plan, Problem, StageChoice
from .pipeline_program import objective_key, within_limits


def contiguous_ranges(n_blocks: int, n_stages: int) -> list[list[tuple[int, int]]]:
    result = []
    for cuts in itertools.combinations(range(n_blocks - 1), n_stages - 1):
        starts = [0, *(c + 1 for c in cuts)]
        ends = [*cuts, n_blocks - 1]
        result.append(list(zip(starts, ends, strict=True)))
    return result


def exhaustive(
    problem: Problem,
    objective: Objective = "cost",
    *,
    deadline: float | None = None,
    budget: float | None = None,
    fixed_ranges: list[tuple[int, int]] | None = None,
) -> tuple[Plan, Evaluation] | None:
    """The best plan by enumeration (micro-batch x partition x tier and replicas per stage)."""
    options = [(m, r) for m in problem.region.tiers_mb for r in problem.replicas]
    n_blocks = len(problem.blocks)
    partitions = (
        [fixed_ranges]
        if fixed_ranges is not None
        else [
            p
            for s in range(problem.min_stages, min(problem.max_stages, n_blocks) + 1)
            for p in contiguous_ranges(n_blocks, s)
        ]
    )
    plans = (
        Plan(mu, tuple(StageChoice(a, b, m, r) for (a, b), (m, r) in zip(ranges, picks, strict=True)))
        for mu in sorted(problem.micro_batch_counts())
        for ranges in partitions
        for picks in itertools.product(options, repeat=len(ranges))
    )
    return best_plan(problem, objective, plans, deadline, budget)


def best_plan(
    problem: Problem,
    objective: Objective,
    plans: Iterable[Plan],
    deadline: float | None = None,
    budget: float | None = None,
) -> tuple[Plan, Evaluation] | None:
    """The best of `plans` within the limits, by the objective (first found wins ties)."""
    model = CostModel(problem)
    best: tuple[tuple[float, float], Plan, Evaluation] | None = None
    for plan in plans:
        evaluation = model.evaluate(plan)
        if not within_limits(problem, evaluation, deadline, budget):
            continue
        key = objective_key(problem, objective, evaluation)
        if best is None or key < best[0]:
            best = (key, plan, evaluation)
    return None if best is None else (best[1], best[2])
