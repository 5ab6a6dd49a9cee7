"""Large pipeline programs solved by bands of the plans' bottleneck (pipeline_milp.solve_for_micro_batch).

Why: the path-flow MILP (planner.build_program) bounds each max term of the iteration time per block,
a convex combination in its relaxation, which can spread the bottleneck stage over a mix of plans
whose bottlenecks sit at different blocks. No one plan can: on the benchmark's 64-block chain the
relaxation is ~2 % below the optimum, and HiGHS branches for tens of seconds to close that.

Every plan has one largest steady term sigma = max over its stages of (n - 1)(phi + beta) (GPipe)
or (n - 1) c (1F1B), ConfigTable.steady. Split by sigma into bands (above, most], the plans of a
band use only configurations of a steady term up to `most`, their pipeline's max terms add up to
more than `above` (build_program's `above` rows), and each of their configurations has a floor of
the iteration time raised to its fills plus `above` (ConfigTable.band). A narrow band's relaxation
is within a fraction of a per cent of its optimum, and its path floors (prune) drop most of its
configurations; most bands fall to those floors alone. The floors of the cost count the largest
tail of a plan's stages too (tail_floors): a band of a small steady term holds plans of replicated
stages, whose gradient syncs (tens of seconds for a Llama-3-8B layer) the band's bottom leaves out.

The bands are searched best first by their lower bound (their path floor, then their LP bound): a
band of few configurations is solved as a MILP against the best plan so far, a larger one split at
the median steady term of its configurations. The best plan found is the optimum once no band's
bound is below it; the bands left when time runs out bound the gap.
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass, field

import numpy as np

from .cost_model import CostModel, Objective, Plan, Problem
from .pipeline_program import (
    SEEDS_PER_BLOCK,
    ConfigTable,
    Floors,
    Solution,
    _indices,
    build_program,
    chosen_plan,
    heuristic_plan,
    objective_key,
    prune,
)
from .pricing import Pricing, StageProgram, price_configurations
from .solver import GAP, Goal, Outcome, SolveStatus, solve_program

#: a band whose program holds at most this many configurations is solved as a MILP (HiGHS takes
#: well under a second on such a band); a larger one is split
MILP_CONFIGS = 400
#: a band holding more is split at once (its path floor its bound): column generation over so many
#: configurations takes seconds
PRICE_CONFIGS = 8000
#: a band wider than this (relative to its top) is split unless it holds at most FEW_CONFIGS: its
#: relaxation leaves its MILP too much to branch on
WIDE = 0.01
FEW_CONFIGS = 100
#: seconds a band's MILP may take when its relaxation could not be priced, before it is split
PROBE_S = 1.0
#: a band this narrow (relative to its top) is not split further but solved as it is
NARROW = 1e-4


@dataclass(order=True)
class Band:
    """The plans whose largest steady term is in (above, most], with a lower bound of their objective."""

    bound: float
    above: float = field(compare=False)
    most: float = field(compare=False)
    table: ConfigTable = field(compare=False)  # the configurations its plans may hold (of its parent)


@dataclass
class BandSearch:
    solution: Solution | None  # the best plan found below the cutoff, or the incumbent given
    bound: float  # proven lower bound of every plan (objective units)
    status: SolveStatus  # "optimal" / "infeasible" once every band is done, else "time limit"
    solver: str
    bands: int  # bands examined


@dataclass
class _Search:
    """The state of one search: the best plan so far and the value every band is pruned against."""

    problem: Problem
    objective: Objective
    mu: int
    deadline: float | None
    budget: float | None
    best: Solution | None
    value: float | None  # plans at or above it are not wanted (the cutoff, then the best plan's value)
    solver: str = "none"

    def offer(self, plan: Plan) -> None:
        """Keep `plan` when it is strictly better (an earlier plan wins ties, the heuristic's first)."""
        evaluation = CostModel(self.problem).evaluate(plan)
        primary = objective_key(self.problem, self.objective, evaluation)[0]
        if self.value is None or primary < self.value:
            self.best = Solution(plan, evaluation, primary, "feasible", math.inf, 0.0, self.solver)
            self.value = primary

    def prune(self, table: ConfigTable) -> tuple[ConfigTable, Floors, float]:
        """The band's configurations that may hold a better plan, with their floors, and a lower bound
        of the band's plans: planner.prune's path floors, then the product floors (product_floors)
        against the best plan and the budget, until neither drops a configuration."""
        goal = Goal(self.objective, self.deadline, self.budget)
        limit = min(
            math.inf if goal.minimises_time or self.value is None else self.value,
            goal.cost_limit(self.problem.iterations),
        )
        while True:
            table, floors = prune(
                self.problem, self.objective, table, deadline=self.deadline, budget=self.budget, cutoff=self.value
            )
            # Every plan of the band holds a configuration whose steady term exceeds its `above`.
            leading = table.steady > table.above
            least = float(floors.least[leading].min()) if leading.any() else math.inf
            if not leading.any() or not math.isfinite(limit) or table.price <= 0:
                return table, floors, least
            floor = product_floors(table)
            keep = floor <= limit * (1 + 1e-9)
            if keep.all():
                return table, floors, least if goal.minimises_time else max(least, float(floor[leading].min()))
            table = table.subset(keep)

    def dominated(self, bound: float) -> bool:
        """No plan worth at least `bound` beats the best so far (within the solvers' gap)."""
        return self.value is not None and bound >= self.value - GAP * abs(self.value)


def product_floors(table: ConfigTable) -> np.ndarray:
    """Per configuration, a lower bound of the cost of a plan that holds it, tighter on a band's plans
    than planner.prune's: the larger of two linearised products of the plan's time and GB.

    A plan's cost is price * t * G + X (G its GB of functions, X its fixed cost), and t >= a + F: a the
    band's `above` (its largest steady term exceeds it), F the stages' fills plus the first stage's
    tail (the overhang is at least that). F and G add up along the plan's path, their product does
    not; but with F >= F0 and G >= G0 (the least fills and GB of any path), (F - F0)(G - G0) >= 0
    gives F G >= F G0 + F0 G - F0 G0, so the cost is at least the sum over the stages of
        price * ((a + F0) GB_s + G0 fill_s) + fixed_s,   less price * F0 G0,
    whose least over the paths through each configuration is two shortest paths. Near the band's
    best plans G is close to G0, so the bound is close to their cost (the relaxation of the MILP
    mixes plans; this floor takes the least fills of one path and the least GB of another only).
    The second floor (tail_floors) counts the configuration's own tail, which this one leaves out."""
    fill = table.fill + np.where(table.first == 0, table.tail, 0.0)
    least_gb = table.least_paths(table.gb, True)[-1]
    least_fill = table.least_paths(fill, True)[-1]
    if not (math.isfinite(least_gb) and math.isfinite(least_fill)):
        return np.full(len(table), np.inf)  # no path through the table: no plan holds any of it
    weight = table.price * ((max(table.above, 0.0) + least_fill) * table.gb + least_gb * fill) + table.fixed
    paths = table.least_paths(weight, True)[table.first] + weight + table.least_paths(weight, False)[table.end]
    return np.maximum(paths - table.price * least_fill * least_gb, tail_floors(table))


#: tail_floors splits the configurations into this many levels of their own term (a few shortest paths each)
TAIL_LEVELS = 12


def tail_floors(table: ConfigTable) -> np.ndarray:
    """Per configuration, a lower bound of the cost of a plan that holds it, by the largest own term
    kappa_s = steady_s + tail_s of the plan's stages: the overhang is at least a stage's tail less the
    backward fills of the stages before it, and the steady terms at least its own, so
        t >= U_s = sum_before forward fill + fill_s + kappa_s + sum_after fill        for every stage s.
    A replicated stage's tail (its gradient sync) can be tens of seconds: a band of a small steady term
    holds fast plans only by many replicas, whose syncs its floor a + F does not see.

    The configurations are split into levels of kappa. A plan whose largest kappa lies in level k holds
    only configurations up to the level's top, and one of level k, c, with t >= U_c; with U >= U0 and
    G >= G0 (the least U of such a path through c, the least GB of such a path), U G >= U G0 + U0 G -
    U0 G0, whose least over the paths is two shortest paths per level, as in product_floors. A plan
    holding a configuration of level k has its largest kappa in level k or above: its floor is the
    least of theirs."""
    n = len(table)
    kappa = table.steady + table.tail
    if not n or table.price <= 0:
        return np.zeros(n)
    price = table.price
    forward_fill = table.fill - table.back_fill
    if table.gpipe and math.isfinite(table.above) and table.above > 0:
        # GPipe's largest forwards are a term of their own, at least those of the stage whose steady
        # term exceeds the band's `above`: a share of it no less than the least of its configurations'.
        leading = table.steady > table.above
        share = float((table.forward[leading] / table.steady[leading]).min()) if leading.any() else 0.0
        kappa = np.maximum(table.forward, share * table.above) + table.drain + table.tail
    own = table.fill + kappa
    tops = np.unique(np.linspace(float(kappa.min()), float(kappa.max()), TAIL_LEVELS + 1)[1:])
    level = np.minimum(np.searchsorted(tops, kappa, side="left"), len(tops) - 1)
    # Row k: the configurations up to level k's top (one shortest path per level, all levels at once).
    inside = kappa[None, :] <= tops[:, None]
    members = level[None, :] == np.arange(len(tops))[:, None]
    rows = table.least_paths_of_rows
    least_gb = rows(np.where(inside, table.gb, np.inf), True)[:, -1]
    u_low = (
        rows(np.where(inside, forward_fill, np.inf), True)[:, table.first]
        + own
        + rows(np.where(inside, table.fill, np.inf), False)[:, table.end]
    )
    u0 = np.where(members, u_low, np.inf).min(axis=1)
    # A level with no plan up to its top, or no path through its own configurations, holds no plan.
    held = np.isfinite(least_gb) & np.isfinite(u0)
    least = np.full(len(tops), np.inf)  # per level, the least cost of a plan whose largest kappa is in it
    if held.any():
        g0, u0, inside, members = least_gb[held, None], u0[held, None], inside[held], members[held]
        before = np.where(inside, price * (g0 * forward_fill + u0 * table.gb) + table.fixed, np.inf)
        after = np.where(inside, price * (g0 * table.fill + u0 * table.gb) + table.fixed, np.inf)
        mine = price * (g0 * own + u0 * table.gb) + table.fixed
        paths = rows(before, True)[:, table.first] + mine + rows(after, False)[:, table.end]
        least[held] = np.where(members, paths, np.inf).min(axis=1) - price * (u0 * g0)[:, 0]
    from_level = np.minimum.accumulate(least[::-1])[::-1]
    return from_level[level]


def search_bands(
    problem: Problem,
    objective: Objective,
    mu: int,
    table: ConfigTable,
    incumbent: Solution | None,
    cutoff: float | None,
    *,
    deadline: float | None,
    budget: float | None,
    stop_at: float,
) -> BandSearch:
    """The best plan of micro-batch size mu over the configurations of `table` (pruned against
    `cutoff`, the value of `incumbent` when it is given), searched by bands of the largest steady term."""
    search = _Search(problem, objective, mu, deadline, budget, incumbent, cutoff)
    queue = [Band(-math.inf, -math.inf, float(table.steady.max()), table)]
    unsettled: list[float] = []  # bounds of the bands a time-limited solve left open
    examined = 0
    while queue and not unsettled:
        band = heapq.heappop(queue)
        if search.dominated(band.bound):
            queue.clear()  # and every band after it
            break
        if time.perf_counter() >= stop_at:
            heapq.heappush(queue, band)
            break
        examined += 1
        unsettled = _examine(search, band, queue, stop_at)
    bounds = [band.bound for band in queue] + unsettled
    settled = not bounds
    bound = min([*bounds, search.value if search.value is not None else math.inf])
    status: SolveStatus = "time limit" if not settled else "optimal" if search.best is not None else "infeasible"
    return BandSearch(search.best, bound, status, search.solver, examined)


def _examine(search: _Search, band: Band, queue: list[Band], stop_at: float) -> list[float]:
    """Settle a band, or split it (onto `queue`). Returns the band's bound when a solve stopped at the
    time limit without settling it."""
    sub, floors, least = search.prune(band.table.band(band.above, band.most))
    if not (sub.steady > band.above).any():
        return []  # no plan of the band may beat the best so far
    # A good plan of the band, cheaply, to prune its configurations by before its program is built.
    found = heuristic_plan(search.problem, search.objective, search.mu, sub, search.deadline, search.budget)
    if found is not None and (search.value is None or found[1] < search.value):
        search.offer(found[0].plan)
        sub, floors, least = search.prune(sub)
        if not (sub.steady > band.above).any():
            return []
    bound = max(band.bound, least)
    if search.dominated(bound):
        return []
    wide = band.most - band.above > WIDE * abs(band.most)
    if len(sub) > MILP_CONFIGS and (not _splittable(sub, band) or (len(sub) <= PRICE_CONFIGS and not wide)):
        priced = _fix(search, band, sub, floors, bound, stop_at)
        if priced is None:
            return []  # settled
        sub, floors, bound = priced
        if time.perf_counter() >= stop_at:
            return [bound]
    if (len(sub) > MILP_CONFIGS or (wide and len(sub) > FEW_CONFIGS)) and _splittable(sub, band):
        # Split at the median steady term of the band's own configurations (below the top); the halves
        # keep what this band's reductions left.
        inside = sub.steady[sub.steady > band.above]
        split = min(float(np.median(inside)), float(inside[inside < band.most].max()))
        heapq.heappush(queue, Band(bound, band.above, split, sub))
        heapq.heappush(queue, Band(bound, split, band.most, sub))
        return []
    stage = _program(search, sub, floors, band)
    outcome, proven = _solve(search, sub, stage, max(0.5, stop_at - time.perf_counter()))
    return [max(bound, proven)] if outcome.status == "time limit" else []


def _fix(
    search: _Search, band: Band, table: ConfigTable, floors: Floors, bound: float, stop_at: float
) -> tuple[ConfigTable, Floors, float] | None:
    """Reduced-cost fixing by the band's relaxation (far tighter than the whole program's): the band's
    configurations that may still hold a better plan, their floors and the band's bound; None when
    the band is settled (no plan of it beats the best, or its MILP was solved)."""
    value = search.value
    stage = _program(search, table, floors, band, cutoff=False)
    pricing = None if value is None else _price(search, table, stage, stop_at)
    if value is None or pricing is None:
        # No feasible relaxation among the seeds: most often the band holds no plan below the best,
        # which HiGHS's presolve of the MILP finds at once (the LP alone takes seconds); a band that
        # does not settle quickly is split.
        probe = min(PROBE_S, max(0.0, stop_at - time.perf_counter()))
        outcome, proven = _solve(search, table, _program(search, table, floors, band), probe)
        return None if outcome.status != "time limit" else (table, floors, max(bound, proven))
    bound = max(bound, pricing.bound / stage.scale)
    known = value * stage.scale * (1 + 1e-9)
    keep = pricing.with_config <= known + 1e-9 * abs(known)
    if search.dominated(bound) or not keep.any():
        return None
    if not keep.all():
        table, floors, least = search.prune(table.subset(keep))
        if not (table.steady > band.above).any():
            return None
        bound = max(bound, least)
    return table, floors, bound


def _solve(search: _Search, table: ConfigTable, stage: StageProgram, time_limit: float) -> tuple[Outcome, float]:
    """The band's MILP against the best plan so far, whose answer is offered as a better plan; with
    the solver's bound in objective units."""
    known = None if search.value is None else search.value * stage.scale * (1 + 1e-9)
    outcome = solve_program(stage.program, time_limit, known)
    search.solver = outcome.solver
    plan = chosen_plan(table, stage, outcome.values, search.mu)
    if plan is not None:
        search.offer(plan)
    return outcome, outcome.bound / stage.scale


def _splittable(table: ConfigTable, band: Band) -> bool:
    """Whether the band is wider than NARROW and holds configurations below its top."""
    inside = table.steady[table.steady > band.above]
    return bool((inside < band.most).any()) and band.most - band.above > NARROW * abs(band.most)


def _program(search: _Search, table: ConfigTable, floors: Floors, band: Band, *, cutoff: bool = True) -> StageProgram:
    """The band's program; without the cutoff (its bounds of the time on each configuration), the
    relaxation of seeds of plans all above the best is still feasible, and priced."""
    return build_program(
        search.problem,
        search.objective,
        search.mu,
        table,
        floors,
        deadline=search.deadline,
        budget=search.budget,
        cutoff=search.value if cutoff else None,
        above=band.above if math.isfinite(band.above) else None,
    )


def _price(search: _Search, table: ConfigTable, stage: StageProgram, stop_at: float) -> Pricing | None:
    """The band's LP relaxation with a bound per configuration (pricing.price_configurations), by column
    generation from the best plan's stages and, from each block, the stages of least floor and those
    of the band's own (one is in every plan of it). None when those hold no feasible relaxation (or
    when time runs out)."""
    weight = table.low if Goal(search.objective).minimises_time else table.least_usd
    seeds = [] if search.best is None else _indices(table, search.best.plan)
    # The band's own configurations too (some stage must be one): the least of them start a path.
    own = np.where(table.steady > table.above, weight, np.inf)
    for edges in table.by_first:
        seeds.extend(int(i) for i in edges[np.argsort(weight[edges], kind="stable")[:SEEDS_PER_BLOCK]])
        seeds.extend(int(i) for i in edges[np.argsort(own[edges], kind="stable")[:SEEDS_PER_BLOCK]])
    return price_configurations(stage, seeds, stop_at)
