"""The inter-region re-plan a run's coordinator makes when a region's capacity changes or a region
leaves: which replicas fit the region's new capacity, and how the run's remaining iterations are
spread over the regions still training, from their measured pace.

Cloudless-Training re-solves its inter-region level from the current state. The compile-time MILP
(`cloudless.compiler.planner.geo`) chose each region's pipeline; mid-run the pipelines are what was built, so
the decision left is the work: each region's remaining iterations, in proportion to its measured
speed, so that the regions reach their meets together (a barrier waits for the slowest), each with at
least one iteration per remaining round. A region trains its share on the data it holds: no data
moves mid-run (the catalog's residency holds whatever the re-plan does).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ...ir.schedule import local_micro_batches
from ...ir.workflow import whole_iterations

_CHANGE = re.compile(r"^(?P<region>[^@=\s]+)@(?P<iteration>\d+)=(?P<functions>\d+)$")
_FAILURE = re.compile(r"^(?P<region>[^@=\s]+)@(?P<iteration>\d+)$")


@dataclass(frozen=True)
class CapacityChange:
    """From iteration `iteration` of its own, `region` runs at most `functions` functions at once."""

    region: str
    iteration: int
    functions: int

    @classmethod
    def parse(cls, text: str) -> CapacityChange:
        match = _CHANGE.match(text.strip())
        if match is None or int(match["functions"]) < 0:
            raise ValueError(
                f"--capacity-change {text!r}: expected REGION@ITERATION=FUNCTIONS, e.g. aws-eu-west-1@40=2"
            )
        return cls(match["region"], int(match["iteration"]), int(match["functions"]))


@dataclass(frozen=True)
class RegionFailure:
    """Injected: from iteration `iteration` of its own, `region` stops answering (its functions are
    killed and its controller says nothing): the other regions find out by the region timeout."""

    region: str
    iteration: int

    @classmethod
    def parse(cls, text: str) -> RegionFailure:
        match = _FAILURE.match(text.strip())
        if match is None:
            raise ValueError(f"--fail-region {text!r}: expected REGION@ITERATION, e.g. aws-eu-west-1@40")
        return cls(match["region"], int(match["iteration"]))


def check_regions(regions: Sequence[str], changes: Sequence[CapacityChange], failures: Sequence[RegionFailure]) -> None:
    """ValueError naming the first change or failure of a region the workflow does not have, or any
    of them with one region (nothing to re-plan between)."""
    if (changes or failures) and len(regions) == 1:
        raise ValueError(
            f"--capacity-change and --fail-region need a workflow of several regions; this one trains in {regions[0]} "
            "alone (see its report.md, 'Between regions')"
        )
    for name in [c.region for c in changes] + [f.region for f in failures]:
        if name not in regions:
            raise ValueError(f"{name}: no such region in workflow.yaml (its regions: {', '.join(sorted(regions))})")


def fit_replicas(planned: Sequence[int], functions: int) -> tuple[int, ...] | None:
    """Replicas per stage that run within `functions` concurrent functions, at most the planned ones:
    the stage with the most replicas gives one up first (the later stage on a tie); None when even
    one replica per stage does not fit."""
    replicas = list(planned)
    if functions < len(replicas):
        return None
    while sum(replicas) > functions:
        most = max(range(len(replicas)), key=lambda s: (replicas[s], s))
        replicas[most] -= 1
    return tuple(replicas)


def slowdown(micro_batches: int, before: Sequence[int], after: Sequence[int]) -> float:
    """How much longer an iteration takes with `after` replicas per stage than with `before`: the
    busiest replica's micro-batches bound a pipeline's iteration."""

    def busiest(replicas: Sequence[int]) -> int:
        return max(len(local_micro_batches(micro_batches, r, 0)) for r in replicas)

    return busiest(after) / busiest(before)


def share_iterations(remaining: int, seconds: Mapping[str, float], least: Mapping[str, int]) -> dict[str, int]:
    """`remaining` iterations over the regions of `seconds` (each one's seconds per iteration), in
    proportion to their speed, each at least its `least`; whole numbers adding up to `remaining`
    (or to the sum of the `least`s, where that is more)."""
    names = sorted(seconds)
    fixed: dict[str, int] = {}
    while True:
        free = [n for n in names if n not in fixed]
        budget = remaining - sum(fixed.values())
        speed = {n: 1.0 / max(seconds[n], 1e-9) for n in free}
        total = math.fsum(speed.values())
        targets = {n: budget * speed[n] / total for n in free} if free and budget > 0 else {n: 0.0 for n in free}
        short = [n for n in free if targets[n] < least[n]]
        if not short:
            break
        fixed.update({n: least[n] for n in short})
    counts = whole_iterations([targets[n] for n in free], max(budget, 0), 0) if free else []
    shares = dict(fixed) | dict(zip(free, counts, strict=True))
    return {n: max(shares[n], least[n]) for n in names}


def extra_rounds(remaining: int, regions: int, rounds: int, iterations: int) -> int:
    """New rounds for `remaining` iterations that no region has a round left for (the others had
    finished, or were in their last round, when a region left): as many as the plan's `rounds` over
    the run's `iterations` give them (the same iterations per round), at least one, and at most one per
    iteration of each of the `regions` that run them."""
    return max(1, min(round(remaining * rounds / iterations), remaining // regions))
