"""Shortest chains of stages with a bounded stage count, for the planner's heuristic under --stages N.

The heuristic's cheapest path over the configurations (boundaries as nodes, a configuration as the
edge from its first block to the boundary after its last) takes any number of stages; with
`--stages N` (min_stages = max_stages = N) its plan is no plan at all, and the MILP is left without
an incumbent. Here the same path with its stage count in [low, high]: a DP over (boundary, stages).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def cheapest_path_with_stages(
    first: np.ndarray,
    end: np.ndarray,
    by_end: Sequence[np.ndarray],
    n_blocks: int,
    weights: np.ndarray,
    low: int,
    high: int,
) -> list[int] | None:
    """The edges (configuration indices) of a shortest path from boundary 0 to `n_blocks` whose number
    of edges is in [low, high] (ties: the fewest stages, then the earliest edges); None if none is
    finite."""
    high = min(high, n_blocks)
    if low > high:
        return None
    best = np.full((high + 1, n_blocks + 1), np.inf)  # best[k, b]: k stages reaching boundary b
    via = np.full((high + 1, n_blocks + 1), -1, dtype=np.int64)
    best[0, 0] = 0.0
    for k in range(1, high + 1):
        for b in range(1, n_blocks + 1):
            edges = by_end[b]
            if not len(edges):
                continue
            lengths = best[k - 1, first[edges]] + weights[edges]
            i = int(np.argmin(lengths))
            if math.isfinite(lengths[i]):
                best[k, b], via[k, b] = lengths[i], edges[i]
    counts = list(range(low, high + 1))
    k = min(counts, key=lambda c: (best[c, n_blocks], c))
    if not math.isfinite(best[k, n_blocks]):
        return None
    path, b = [], n_blocks
    while k > 0:
        edge = int(via[k, b])
        path.append(edge)
        b, k = int(first[edge]), k - 1
    assert b == 0 and all(end[e] > first[e] for e in path)
    return path[::-1]
