"""Baseline plans on the same cost model, for plan.json and as incumbents of the MILP.

- data-parallel: the whole model in every function (LambdaML), best tier and replica count;
- equal-parameters: contiguous stages with about equal parameter bytes (PyTorch pipelining and
  DeepSpeed's default), best stage count and micro-batch size;
- time-balanced: contiguous stages with about equal measured time (torchgpipe's balance by time).
Each deploys one (tier, replicas) for all its stages, as those systems use homogeneous workers;
the best such choice is found by enumeration on the same cost model.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from ..frontend.coarsen import balanced_ranges
from .cost_model import CostModel, Evaluation, Objective, Plan, Problem, StageChoice
from .exhaustive import best_plan


@dataclass
class Baseline:
    name: str
    description: str
    plan: Plan | None
    evaluation: Evaluation | None
    reason: str = ""

    def ratios(self, chosen: Evaluation) -> tuple[float | None, float | None]:
        """The chosen plan's (time, cost) over this baseline's: below 1 means the plan is better; None
        where the baseline's figure is zero (a catalog with zero prices), so no ratio exists."""
        assert self.evaluation is not None
        return (
            ratio(chosen.iteration_s, self.evaluation.iteration_s),
            ratio(chosen.cost_usd, self.evaluation.cost_usd),
        )


def ratio(ours: float, theirs: float) -> float | None:
    """ours / theirs, or None when that is no finite number (theirs zero, or either not finite): what
    plan.json writes as null and the report and the CLI as n/a."""
    if not (math.isfinite(ours) and math.isfinite(theirs)) or theirs <= 0:
        return None
    value = ours / theirs
    return value if math.isfinite(value) else None


def ratio_text(value: float | None) -> str:
    """A ratio as the CLI prints it: `0.83x`, or `n/a` when there is none."""
    return "n/a" if value is None else f"{value:.2f}x"


def _best_uniform(
    problem: Problem,
    objective: Objective,
    partitions: list[list[tuple[int, int]]],
    deadline: float | None,
    budget: float | None,
) -> tuple[Plan, Evaluation] | None:
    """The best plan over these partitions with one (tier, replicas) for every stage, as pipeline
    systems deploy homogeneous workers; exact by enumeration on the cost model."""
    plans = (
        Plan(mu, tuple(StageChoice(a, b, m, r) for a, b in ranges))
        for mu in sorted(problem.micro_batch_counts())
        for ranges in partitions
        for m in problem.region.tiers_mb
        for r in problem.replicas
    )
    return best_plan(problem, objective, plans, deadline, budget)


def _why_not(problem: Problem, partitions: list[list[tuple[int, int]]]) -> str:
    """The smallest memory any stage of these partitions needs beyond the largest tier, if any."""
    model = CostModel(problem)
    largest = max(problem.region.tiers_mb)
    mu = min(problem.micro_batch_counts(), default=problem.profile_batch)
    worst = None
    for ranges in partitions:
        need = 0.0
        for index, (first, last) in enumerate(ranges):
            choice = StageChoice(first, last, largest, max(problem.replicas))
            terms = model.stage_terms(choice, index, len(ranges), mu)
            need = max(need, terms.memory_mb)
        if worst is None or need < worst[0]:
            worst = (need, ranges)
    if worst and worst[0] > largest:
        return (
            f"its largest stage needs {worst[0]:.0f} MB even on the {largest} MB tier with "
            f"{max(problem.replicas)} replicas at micro-batch {mu}"
        )
    return "no stage count fits the function limit, deadline or budget"


def baselines(
    problem: Problem,
    objective: Objective,
    *,
    deadline: float | None = None,
    budget: float | None = None,
) -> list[Baseline]:
    n_blocks = len(problem.blocks)
    stage_counts = range(1, min(problem.max_stages, n_blocks) + 1)

    def split_by(weight: Callable[[int], float]) -> list[list[tuple[int, int]]]:
        weights = [weight(b) for b in range(n_blocks)]
        return [balanced_ranges(weights, s) for s in stage_counts]

    specs = [
        ("data-parallel", "whole model in every function (LambdaML), best tier and replicas", [[(0, n_blocks - 1)]]),
        (
            "equal-parameters",
            "equal parameter bytes per stage (PyTorch pipelining, DeepSpeed)",
            split_by(
                lambda b: problem.blocks[b].param_bytes + sum(problem.shared_bytes[n] for n in problem.blocks[b].shared)
            ),
        ),
        (
            "time-balanced",
            "equal measured time per stage (torchgpipe)",
            split_by(lambda b: problem.blocks[b].forward_s + problem.blocks[b].backward_s),
        ),
    ]
    result = []
    for name, description, partitions in specs:
        best = _best_uniform(problem, objective, partitions, deadline, budget)
        if best is None:
            result.append(Baseline(name, description, None, None, _why_not(problem, partitions)))
        else:
            result.append(Baseline(name, description, best[0], best[1]))
    return result
