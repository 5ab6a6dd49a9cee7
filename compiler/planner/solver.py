"""The one MILP adapter of both planning levels, and what they minimise under which limits.

Both the pipeline MILP (planner.py) and the inter-region MILP (geo.py) are built by index into a
`Program` and solved by `solve_program`: HiGHS through highspy, or CBC through pulp (pulp bundles
its binary) when highspy is missing or `backend="CBC"`. Either way the answer is an `Outcome` in
one status vocabulary:

- "optimal": the solution is optimal (within the relative gap `GAP`), `bound` is its value;
- "infeasible": no solution exists (below the cutoff, when one is given), `bound` is inf;
- "time limit": the solver stopped first; `values` is the best solution found, if any, and `bound`
  a proven lower bound (-inf when the solver has none).

Callers add, per candidate (a micro-batch size, a server region), "pruned" (proven not to beat a
plan known from elsewhere) and "no solution in time"; a plan's answer is "optimal" or "feasible"
(found, with a gap). These strings are printed in plan.json and the report.

`Goal` is the objective with its deadline and budget: the key plans are compared by, the check of a
plan's figures against the limits, and the same limits and objective set on a Program.
"""

from __future__ import annotations

import math
import os
import sys
import time
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from .cost_model import Objective

if TYPE_CHECKING:
    import highspy

SolveStatus = Literal["optimal", "infeasible", "time limit"]
#: what one candidate of a level ends with (plan.json's "candidates")
CandidateStatus = Literal["optimal", "infeasible", "time limit", "pruned", "no solution in time"]
#: what the chosen plan says of itself
PlanStatus = Literal["optimal", "feasible"]
Backend = Literal["HiGHS", "CBC"]

#: relative MIP gap the solvers stop at
GAP = 1e-7
#: relative slack of every deadline and budget (a plan at the limit, up to rounding, is within)
TOLERANCE = 1e-9


@dataclass(frozen=True)
class Goal:
    """The objective and the limits of a whole run: `deadline` in seconds, `budget` in USD."""

    objective: Objective = "cost"
    deadline: float | None = None
    budget: float | None = None

    def check(self) -> None:
        """The constrained objectives need their limit."""
        if self.objective == "cost-under-deadline" and self.deadline is None:
            raise ValueError("--objective cost-under-deadline needs --deadline SECONDS")
        if self.objective == "time-under-budget" and self.budget is None:
            raise ValueError("--objective time-under-budget needs --budget USD")

    @property
    def minimises_time(self) -> bool:
        return self.objective in ("time", "time-under-budget")

    def key(self, seconds: float, usd: float) -> tuple[float, float]:
        """What plans are compared by: (primary, tie-break)."""
        return (seconds, usd) if self.minimises_time else (usd, seconds)

    def within(self, seconds: float, usd: float) -> bool:
        """Whether a run of `seconds` costing `usd` meets the deadline and the budget."""
        if self.deadline is not None and seconds > self.deadline * (1 + TOLERANCE):
            return False
        return self.budget is None or usd <= self.budget * (1 + TOLERANCE)

    def time_limit(self, runs: float = 1.0) -> float:
        """The most seconds of one of `runs` units (an iteration of `iterations`), inf without a deadline."""
        return math.inf if self.deadline is None else self.deadline / runs * (1 + TOLERANCE)

    def cost_limit(self, runs: float = 1.0) -> float:
        """The most USD of one of `runs` units, inf without a budget."""
        return math.inf if self.budget is None else self.budget / runs * (1 + TOLERANCE)

    def constrain(
        self, program: Program, time: int, cost: list[tuple[int, float]], runs: float = 1.0, usd: float = 1.0
    ) -> None:
        """Set the program's objective (the `time` column, or the `cost` entries) and its limits: the
        deadline bounds the time column (per unit, as `time_limit`), the budget the run's cost. The
        time and cost are of one of `runs` units; the cost entries in `usd` program units per dollar."""
        if self.deadline is not None:
            program.upper[time] = min(program.upper[time], self.time_limit(runs))
        if self.budget is not None:
            # All the run's units against the budget itself: the row's coefficients stay those of the
            # objective (times `runs`), which keeps the solver's arithmetic as it was.
            program.row([(j, v * runs) for j, v in cost], upper=self.budget * usd)
        if self.minimises_time:
            program.cost[time] = 1.0
        else:
            for j, v in cost:
                program.cost[j] += v


class Program:
    """A MILP in sparse form, built by index (pulp's expression objects are too slow for 10^5
    columns): columns with bounds, cost and integrality; rows lower <= sum coef * column <= upper."""

    def __init__(self) -> None:
        self.lower: list[float] = []
        self.upper: list[float] = []
        self.cost: list[float] = []
        self.integer: list[int] = []
        self.row_lower: list[float] = []
        self.row_upper: list[float] = []
        self.row_start: list[int] = [0]
        self.row_index: list[int] = []
        self.row_value: list[float] = []
        self.row_group: list[int] = []  # the configuration a row alone concerns, else -1

    def columns(self, count: int, lower: float = 0.0, upper: float = math.inf, integer: bool = False) -> list[int]:
        first = len(self.lower)
        self.lower.extend([lower] * count)
        self.upper.extend([upper] * count)
        self.cost.extend([0.0] * count)
        if integer:
            self.integer.extend(range(first, first + count))
        return list(range(first, first + count))

    def column(self, lower: float = 0.0, upper: float = math.inf, integer: bool = False) -> int:
        return self.columns(1, lower, upper, integer)[0]

    def row(
        self, entries: list[tuple[int, float]], lower: float = -math.inf, upper: float = math.inf, group: int = -1
    ) -> None:
        for index, value in entries:
            if value:
                self.row_index.append(index)
                self.row_value.append(value)
        self.row_start.append(len(self.row_index))
        self.row_lower.append(lower)
        self.row_upper.append(upper)
        self.row_group.append(group)


@dataclass
class Outcome:
    values: list[float] | None  # a feasible solution, if found
    bound: float  # proven lower bound of the objective (inf when infeasible)
    status: SolveStatus
    solver: Backend


#: The solvers' banner and log reach stdout only when this is set (cloudless-compile --verbose).
solver_log: ContextVar[bool] = ContextVar("solver_log", default=False)


def new_highs() -> highspy.Highs:
    """A HiGHS instance, silent unless `solver_log` is set. HiGHS prints its banner from its C++
    constructor straight to file descriptor 1 (once a process), before any option can be set: the
    descriptor points at /dev/null while the instance is built."""
    import highspy

    if solver_log.get():
        return highspy.Highs()
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 1)
            h = highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    h.setOptionValue("output_flag", False)
    return h


def highs_available() -> bool:
    try:
        import highspy  # noqa: F401
    except ImportError:
        return False
    return True


def solve_program(
    program: Program, time_limit: float | None, cutoff: float | None = None, backend: Backend | None = None
) -> Outcome:
    """Solve with HiGHS when installed (or CBC, when asked or when it is not). `cutoff` is a known
    upper bound of the objective: HiGHS may ignore solutions above it (CBC does not use it)."""
    if backend == "CBC" or (backend is None and not highs_available()):
        return _solve_cbc(program, time_limit)
    return _solve_highs(program, time_limit, cutoff)


def _solve_highs(program: Program, time_limit: float | None, cutoff: float | None) -> Outcome:
    import highspy
    import numpy as np

    inf = highspy.kHighsInf
    h = new_highs()
    h.setOptionValue("mip_rel_gap", GAP)
    h.setOptionValue("threads", 1)
    # Probing the binaries in presolve (rule bit 15) and restarting after the root take most of the
    # time on the pipeline's path programs and rarely pay off.
    h.setOptionValue("presolve_rule_off", 1 << 15)
    h.setOptionValue("mip_allow_restart", False)
    if time_limit is not None:
        h.setOptionValue("time_limit", float(time_limit))
    if cutoff is not None:
        h.setOptionValue("objective_bound", float(cutoff))
    n = len(program.lower)
    h.addVars(n, np.minimum(np.array(program.lower), inf), np.minimum(np.array(program.upper), inf))
    h.changeColsCost(n, np.arange(n, dtype=np.int32), np.array(program.cost))
    if program.integer:
        integer = np.array(program.integer, dtype=np.int32)
        h.changeColsIntegrality(len(integer), integer, np.full(len(integer), 1, dtype=np.uint8))
    h.addRows(
        len(program.row_lower),
        np.maximum(np.array(program.row_lower), -inf),
        np.minimum(np.array(program.row_upper), inf),
        len(program.row_index),
        np.array(program.row_start[:-1], dtype=np.int32),
        np.array(program.row_index, dtype=np.int32),
        np.array(program.row_value),
    )
    started = time.perf_counter()
    h.run()
    status = h.getModelStatus()
    if status == highspy.HighsModelStatus.kSolveError:
        # HiGHS's final check may find a solution it reduced in presolve infeasible by its 1e-6
        # tolerance (seen on the inter-region program); solved again without presolve, it is not.
        h.clearSolver()
        h.setOptionValue("presolve", "off")
        if time_limit is not None:
            h.setOptionValue("time_limit", max(0.5, float(time_limit) - (time.perf_counter() - started)))
        h.run()
        status = h.getModelStatus()
    info = h.getInfo()
    has_solution = info.primal_solution_status == 2  # kSolutionStatusFeasible
    values = list(h.getSolution().col_value) if has_solution else None
    if status == highspy.HighsModelStatus.kOptimal:
        return Outcome(values, info.objective_function_value, "optimal", "HiGHS")
    # Every program here is bounded, so "unbounded or infeasible" from presolve means infeasible.
    none = (
        highspy.HighsModelStatus.kInfeasible,
        highspy.HighsModelStatus.kUnboundedOrInfeasible,
        highspy.HighsModelStatus.kObjectiveBound,
    )
    if status in none and not has_solution:
        return Outcome(None, math.inf, "infeasible", "HiGHS")
    bound = info.mip_dual_bound if math.isfinite(info.mip_dual_bound) else -math.inf
    return Outcome(values, bound, "time limit", "HiGHS")


def _solve_cbc(program: Program, time_limit: float | None) -> Outcome:
    import pulp

    lp = pulp.LpProblem("cloudless", pulp.LpMinimize)
    integer = set(program.integer)
    columns = [
        pulp.LpVariable(
            f"v{i}",
            lowBound=None if math.isinf(lo) else lo,
            upBound=None if math.isinf(up) else up,
            cat="Integer" if i in integer else "Continuous",
        )
        for i, (lo, up) in enumerate(zip(program.lower, program.upper, strict=True))
    ]
    lp += pulp.LpAffineExpression((columns[i], c) for i, c in enumerate(program.cost) if c)
    for k, (lo, up) in enumerate(zip(program.row_lower, program.row_upper, strict=True)):
        start, end = program.row_start[k], program.row_start[k + 1]
        if start == end:
            # pulp cannot write a row without columns: it holds or the program is infeasible.
            if lo > 0 or up < 0:
                return Outcome(None, math.inf, "infeasible", "CBC")
            continue
        expr = pulp.LpAffineExpression((columns[program.row_index[j]], program.row_value[j]) for j in range(start, end))
        if lo == up:
            lp += expr == lo
        else:
            if not math.isinf(lo):
                lp += expr >= lo
            if not math.isinf(up):
                lp += expr <= up
    lp.solve(pulp.PULP_CBC_CMD(msg=solver_log.get(), timeLimit=time_limit, gapRel=GAP))
    if pulp.LpStatus[lp.status] == "Infeasible":
        return Outcome(None, math.inf, "infeasible", "CBC")
    if lp.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        return Outcome(None, -math.inf, "time limit", "CBC")
    values = [v.value() or 0.0 for v in columns]
    # pulp reports a time-limited CBC run as "Optimal" with an integer-feasible solution: no proof.
    if lp.sol_status != pulp.LpSolutionOptimal:
        return Outcome(values, -math.inf, "time limit", "CBC")
    return Outcome(values, float(pulp.value(lp.objective) or 0.0), "optimal", "CBC")
