"""The heuristic's stage-bounded cheapest path against every path, on small random chains."""

from __future__ import annotations

import itertools
import random

import numpy as np

from cloudless.compiler.planner.paths import cheapest_path_with_stages


def _paths(edges: list[tuple[int, int]], n: int, at: int = 0) -> list[list[int]]:
    if at == n:
        return [[]]
    return [[i, *rest] for i, (a, b) in enumerate(edges) if a == at for rest in _paths(edges, n, b)]


def test_the_stage_bounded_path_is_the_cheapest_of_every_path_with_that_many_stages() -> None:
    rng = random.Random(3)
    for _ in range(200):
        n = rng.randint(1, 6)
        edges = [(a, b) for a, b in itertools.combinations(range(n + 1), 2) if rng.random() < 0.7]
        weights = np.array([rng.choice([rng.uniform(0, 10), np.inf]) for _ in edges] or [0.0])[: len(edges)]
        first = np.array([a for a, _ in edges], dtype=np.int64)
        end = np.array([b for _, b in edges], dtype=np.int64)
        by_end = [np.flatnonzero(end == b) for b in range(n + 1)]
        low = rng.randint(1, 4)
        high = rng.randint(low, 5)
        got = cheapest_path_with_stages(first, end, by_end, n, weights, low, high)
        allowed = [p for p in _paths(edges, n) if low <= len(p) <= high and np.isfinite(weights[p].sum())]
        if not allowed:
            assert got is None
            continue
        assert got is not None and low <= len(got) <= high
        assert [edges[i][0] for i in got][0] == 0 and edges[got[-1]][1] == n
        assert all(edges[a][1] == edges[b][0] for a, b in itertools.pairwise(got))
        assert abs(weights[got].sum() - min(weights[p].sum() for p in allowed)) < 1e-9
