"""The MILP of one micro-batch size as the planner builds it (`StageProgram`), and its LP relaxation by
column generation (`price_configurations`): a lower bound of every plan and, per configuration, of
every plan containing it, for reduced-cost fixing before the MILP is solved."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from .solver import Program, new_highs


@dataclass
class StageProgram:
    """The MILP of one micro-batch size over a set of configurations, with what the column generation
    needs to know of it: each configuration's columns (x_c, and g_c = x_c t when the cost is an
    objective or a constraint) and the bounds T_c <= g_c / x_c <= T^max_c its own two rows impose."""

    program: Program
    x: list[int]
    g: list[int]
    g_low: np.ndarray
    g_high: np.ndarray
    scale: float  # objective units per dollar (cost) or per second (time)


@dataclass
class Pricing:
    """What the LP relaxation says of every configuration: a lower bound of every plan's objective
    (the Lagrangian bound at the duals found, program units) and, per configuration, a lower bound of
    every plan that contains it."""

    bound: float
    with_config: np.ndarray
    rounds: int
    columns: int


def price_configurations(stage: StageProgram, initial: list[int], stop_at: float) -> Pricing | None:
    """The LP relaxation of the program by column generation, for reduced-cost fixing.

    The LP of all configurations takes HiGHS tens of seconds at 64 blocks, though few configurations
    carry its optimum. So: solve the LP over a few configurations, price all of them against its
    duals y, add those that could lower it, and repeat (the restricted LP warm-starts). Each
    configuration's columns (x_c, g_c) with its own two rows span the cone of (1, T_c) and
    (1, T^max_c), so relaxing only the rows shared by many configurations gives, for any y, the
    Lagrangian bound

        L(y) = sum_shared y_i rhs_i + sum_core min_bounds d_j z_j + sum_c min(0, q_c),
        q_c = dx_c + min(T_c dg_c, T^max_c dg_c)       (d = c - A'y, the reduced costs)

    which is the LP's optimum once no q_c < 0. A plan containing c then costs at least
    L(y) - min(0, q_c) + q_c: the configurations for which that exceeds a known plan can be dropped,
    exactly. Returns None when HiGHS is missing or the LP cannot be solved this way."""
    try:
        import highspy
    except ImportError:
        return None
    program = stage.program
    n_groups = len(stage.x)
    n_cols, n_rows = len(program.lower), len(program.row_lower)
    inf = highspy.kHighsInf
    lower, upper = np.array(program.lower), np.array(program.upper)
    cost = np.array(program.cost)
    row_lower, row_upper = np.array(program.row_lower), np.array(program.row_upper)
    row_group = np.array(program.row_group)
    entry_row = np.repeat(np.arange(n_rows), np.diff(program.row_start))
    entry_col = np.array(program.row_index)
    entry_value = np.array(program.row_value)
    column_group = np.full(n_cols, -1)
    column_group[stage.x] = np.arange(n_groups)
    if stage.g:
        column_group[stage.g] = np.arange(n_groups)
    shared_rows = np.flatnonzero(row_group < 0)
    core = np.flatnonzero(column_group < 0)
    # Column-major entries, to add a configuration's columns to the restricted LP.
    by_column = np.argsort(entry_col, kind="stable")
    column_start = np.searchsorted(entry_col[by_column], np.arange(n_cols + 1))
    private_rows: list[list[int]] = [[] for _ in range(n_groups)]
    for r in np.flatnonzero(row_group >= 0):
        private_rows[row_group[r]].append(int(r))

    h = new_highs()
    h.setOptionValue("threads", 1)
    position = np.full(n_cols, -1)  # column -> its index in the restricted LP
    row_position = np.full(n_rows, -1)
    position[core] = np.arange(len(core))
    h.addVars(len(core), np.minimum(lower[core], inf), np.minimum(upper[core], inf))
    h.changeColsCost(len(core), np.arange(len(core), dtype=np.int32), cost[core])
    in_core = column_group[entry_col] < 0
    shared_entries = np.flatnonzero(in_core & (row_group[entry_row] < 0))
    row_position[shared_rows] = np.arange(len(shared_rows))
    counts = np.bincount(row_position[entry_row[shared_entries]], minlength=len(shared_rows))
    h.addRows(
        len(shared_rows),
        np.maximum(row_lower[shared_rows], -inf),
        np.minimum(row_upper[shared_rows], inf),
        len(shared_entries),
        np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int32),
        position[entry_col[shared_entries]].astype(np.int32),
        entry_value[shared_entries],
    )
    added = np.zeros(n_groups, dtype=bool)

    def add(groups: np.ndarray) -> None:
        columns = [stage.x[k] for k in groups] + ([stage.g[k] for k in groups] if stage.g else [])
        starts: list[int] = []
        rows: list[int] = []
        values: list[float] = []
        for j in columns:
            span = by_column[column_start[j] : column_start[j + 1]]
            span = span[row_group[entry_row[span]] < 0]
            starts.append(len(rows))
            rows.extend(row_position[entry_row[span]])
            values.extend(entry_value[span])
        first = h.getNumCol()
        position[columns] = np.arange(first, first + len(columns))
        h.addCols(
            len(columns),
            cost[columns],
            np.minimum(lower[columns], inf),
            np.minimum(upper[columns], inf),
            len(rows),
            np.array(starts, dtype=np.int32),
            np.array(rows, dtype=np.int32),
            np.array(values, dtype=np.float64),
        )
        mine = [r for k in groups for r in private_rows[k]]
        if mine:
            spans = [np.arange(program.row_start[r], program.row_start[r + 1]) for r in mine]
            h.addRows(
                len(mine),
                np.maximum(row_lower[mine], -inf),
                np.minimum(row_upper[mine], inf),
                sum(len(s) for s in spans),
                np.array([0] + list(np.cumsum([len(s) for s in spans])[:-1]), dtype=np.int32),
                position[entry_col[np.concatenate(spans)]].astype(np.int32),
                entry_value[np.concatenate(spans)],
            )
        added[groups] = True

    low_g = stage.g_low if stage.g else np.zeros(n_groups)
    high_g = stage.g_high if stage.g else np.zeros(n_groups)
    tolerance = 1e-7
    best: Pricing | None = None
    add(np.array(sorted(set(initial)), dtype=np.int64))
    rounds = 0
    while True:
        rounds += 1
        h.run()
        if h.getModelStatus() != highspy.HighsModelStatus.kOptimal:
            return best
        y = np.zeros(n_rows)
        y[shared_rows] = np.array(h.getSolution().row_dual)[row_position[shared_rows]]
        y_entry = np.where(row_group[entry_row] < 0, y[entry_row], 0.0)
        reduced = cost - np.bincount(entry_col, weights=entry_value * y_entry, minlength=n_cols)
        dx = reduced[stage.x]
        dg = reduced[stage.g] if stage.g else np.zeros(n_groups)
        q = dx + np.minimum(low_g * dg, high_g * dg)
        # L(y): the shared rows at the side their dual prices, the core columns at their best bound.
        ys = y[shared_rows]
        side = np.where(ys > 0, row_lower[shared_rows], row_upper[shared_rows])
        active = np.abs(ys) > tolerance
        if np.any(~np.isfinite(side[active])):
            return best
        bound = float(np.sum(ys[active] * side[active]))
        dc = reduced[core]
        at = np.where(dc > 0, lower[core], upper[core])
        active = np.abs(dc) > tolerance
        if np.any(~np.isfinite(at[active])):
            return best
        bound += float(np.sum(dc[active] * at[active])) + float(np.minimum(q, 0.0).sum())
        if best is None or bound > best.bound:
            best = Pricing(bound, bound - np.minimum(q, 0.0) + q, rounds, int(added.sum()))
        improving = np.flatnonzero((q < -tolerance * max(1.0, abs(h.getInfo().objective_function_value))) & ~added)
        if not len(improving) or time.perf_counter() > stop_at:
            best.rounds, best.columns = rounds, int(added.sum())
            return best
        take = max(50, n_groups // 50)
        add(improving[np.argsort(q[improving], kind="stable")[:take]])
