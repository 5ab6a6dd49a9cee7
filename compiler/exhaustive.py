"""Exhaustive search over every plan of a small problem: the ground truth the MILP is checked against."""

from __future__ import annotations

import itertools

from cloudless.compiler.cost_model import CostModel, Evaluation, Objective, Plan, Problem, StageChoice
from cloudless.compiler.planner import objective_key, within_limits


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
    model = CostModel(problem)
    options = [(m, r) for m in problem.region.tiers_mb for r in problem.replicas]
    best: tuple[tuple[float, float], Plan, Evaluation] | None = None
    n_blocks = len(problem.blocks)
    partitions = (
        [fixed_ranges]
        if fixed_ranges is not None
        else [p for s in range(1, min(problem.max_stages, n_blocks) + 1) for p in contiguous_ranges(n_blocks, s)]
    )
    for mu in sorted(problem.micro_batch_counts()):
        for ranges in partitions:
            for picks in itertools.product(options, repeat=len(ranges)):
                plan = Plan(mu, tuple(StageChoice(a, b, m, r) for (a, b), (m, r) in zip(ranges, picks, strict=True)))
                evaluation = model.evaluate(plan)
                if not within_limits(problem, evaluation, deadline, budget):
                    continue
                key = objective_key(problem, objective, evaluation)
                if best is None or key < best[0]:
                    best = (key, plan, evaluation)
    return None if best is None else (best[1], best[2])
