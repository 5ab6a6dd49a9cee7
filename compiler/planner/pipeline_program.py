"""The pieces of the joint pipeline plan's MILP (pipeline_milp.py puts them together): the stage
configurations of one micro-batch size (stage_configs) and their table (ConfigTable), the path floors that
prune it (prune), a plan found without a solver to prune by (heuristic_plan), the program over what is left
(build_program) and the plan its solution chooses (chosen_plan). The band search (bands.py) builds on the
same pieces.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .cost_model import CostModel, Evaluation, Objective, Plan, Problem, StageChoice, StageTerms
from .paths import cheapest_path_with_stages
from .pricing import StageProgram
from .solver import CandidateStatus, Goal, Program


@dataclass
class Solution:
    plan: Plan
    evaluation: Evaluation
    objective_value: float
    status: str  # solver.PlanStatus once solve() returns
    gap: float
    solve_s: float
    solver: str
    candidates: dict[int, CandidateStatus] = field(default_factory=dict)


SEEDS_PER_BLOCK = 5  # the restricted LP starts from the heuristic's plan and these per block


class Infeasible(Exception):
    """No plan satisfies the constraints; the message names the tightest bound."""


class OutOfTime(Infeasible):
    """No plan found before the solver's time limit, and none proven impossible."""


def objective_key(problem: Problem, objective: Objective, evaluation: Evaluation) -> tuple[float, float]:
    """What is minimised: (primary, tie-break), per iteration."""
    return Goal(objective).key(evaluation.iteration_s, evaluation.cost_usd)


def within_limits(problem: Problem, evaluation: Evaluation, deadline: float | None, budget: float | None) -> bool:
    """A feasible plan of at least `min_stages` stages whose run (all its iterations) meets the deadline
    and the budget."""
    runs = problem.iterations
    return (
        evaluation.feasible
        and len(evaluation.stages) >= problem.min_stages
        and Goal("cost", deadline, budget).within(evaluation.iteration_s * runs, evaluation.cost_usd * runs)
    )


def check_objective(objective: Objective, deadline: float | None, budget: float | None) -> None:
    Goal(objective, deadline, budget).check()


def stage_configs(
    problem: Problem, mu: int, ranges: list[tuple[int, int]] | None = None
) -> list[tuple[StageChoice, StageTerms, int]]:
    """Every (block range, tier, replicas) that fits in memory as some stage, with its terms and the
    most stages that may run from it to the end (1F1B holds more activations the earlier it sits).
    `ranges` restricts the block ranges considered (a fixed partition).

    A stage's memory does not depend on its tier (cost_model.config_terms), so the tiers are tried
    from the largest down and the smaller ones are skipped once one does not fit."""
    model = CostModel(problem)
    n_blocks = len(problem.blocks)
    limit = min(problem.max_stages, n_blocks)
    configs: list[tuple[StageChoice, StageTerms, int]] = []
    spans = ranges if ranges is not None else [(a, b) for a in range(n_blocks) for b in range(a, n_blocks)]
    tiers = sorted(problem.region.tiers_mb, reverse=True)
    for first, last in spans:
        is_first, is_last = first == 0, last == n_blocks - 1
        # Stages from here to the end, this one included: 1 for the last, else as many as the
        # blocks left and the stage limit allow.
        most = 1 if is_last else min(n_blocks - first, limit if is_first else limit - 1)
        one_replica = bool(problem.sequenced(first, last))  # a buffer changed in sequence: one replica
        for r in problem.replicas:
            if r > problem.function_limit or (r > 1 and one_replica):
                continue
            found = []
            for m in tiers:
                choice = StageChoice(first, last, m, r)
                terms = model.config_terms(choice, is_first, is_last, 1, mu)
                if terms.memory_mb > m:
                    break
                fits = most if problem.schedule == "gpipe" else 1  # GPipe memory does not depend on the depth
                while fits < most and model.config_terms(choice, is_first, is_last, fits + 1, mu).memory_mb <= m:
                    fits += 1
                found.append((choice, terms, fits))
            configs.extend(reversed(found))
    # The order of the original enumeration: range, tier, replicas.
    order = {m: i for i, m in enumerate(problem.region.tiers_mb)}
    configs.sort(key=lambda config: (config[0].first, config[0].last, order[config[0].tier_mb], config[0].replicas))
    return configs


class ConfigTable:
    """The stage configurations of one micro-batch size as arrays (one entry per configuration),
    for the vectorised passes: pruning, the heuristic and the pricing of the LP's columns."""

    ARRAYS = (
        "first",
        "end",
        "gb",
        "fixed",
        "fill",
        "back_fill",
        "tail",
        "forward",
        "drain",
        "steady",
        "low",
        "least_usd",
    )

    def __init__(self, problem: Problem, mu: int, configs: list[tuple[StageChoice, StageTerms, int]]) -> None:
        model = CostModel(problem)
        n_blocks = len(problem.blocks)
        per_replica = {r: math.ceil(problem.global_batch // mu / r) for r in problem.replicas}
        gpipe = problem.schedule == "gpipe"
        self.configs = configs
        self.n_blocks = n_blocks
        self.first = np.array([c.first for c, _, _ in configs], dtype=np.int64)
        self.end = np.array([c.last + 1 for c, _, _ in configs], dtype=np.int64)  # the boundary after it
        extra = np.array([per_replica[c.replicas] - 1 for c, _, _ in configs], dtype=float)
        self.gb = np.array([c.replicas * c.tier_mb / 1024 for c, _, _ in configs])
        self.fixed = np.array([model.request_usd(c) + model.storage_usd(t) for c, t, _ in configs])
        self.fill = np.array([t.forward_fill_s + t.backward_fill_s for _, t, _ in configs])
        self.back_fill = np.array([t.backward_fill_s for _, t, _ in configs])
        self.tail = np.array([t.tail_s for _, t, _ in configs])
        self.forward = extra * np.array([t.forward_s for _, t, _ in configs])  # GPipe's steady forwards
        self.drain = extra * np.array([t.backward_s if gpipe else t.cycle_s for _, t, _ in configs])
        # The steady term a stage alone imposes: its forwards and backwards (GPipe) or its cycles (1F1B).
        self.steady = self.forward + self.drain if gpipe else self.drain
        # A lower bound of the iteration time when the configuration is chosen: its own fill and steady
        # term, and every other block computed once, at best on the fastest tier (its tail may overlap).
        fastest = min(model.kappa(m) for m in problem.region.tiers_mb) * mu / problem.profile_batch
        work = np.array([0.0] + [b.forward_s + b.backward_s for b in problem.blocks]).cumsum()
        self.low = self.fill + self.steady + fastest * (work[-1] - (work[self.end] - work[self.first]))
        self.price = problem.region.prices.gb_second
        self.gpipe = gpipe  # the steady term holds the forwards (their max is a term of its own)
        self.above = -math.inf  # `low` counts this much of the largest steady term at least (band)
        self.least_usd = self._least_usd()
        self.by_end = [np.flatnonzero(self.end == b) for b in range(n_blocks + 1)]
        self.by_first = [np.flatnonzero(self.first == b) for b in range(n_blocks + 1)]

    def _least_usd(self) -> np.ndarray:
        """A lower bound of what each configuration alone adds to a plan's cost."""
        return self.price * self.gb * self.low + self.fixed

    def __len__(self) -> int:
        return len(self.configs)

    def band(self, above: float, most: float) -> ConfigTable:
        """The configurations of the plans whose largest steady term is in (above, most] (planner_bands):
        those of a steady term up to `most`, each with its floor of the iteration time raised to what
        such a plan takes at least, its fills and `above` (ConfigTable.low counts its own steady term)."""
        table = self.subset(self.steady <= most)
        # Raised from this table's own band (a band's table is its parent band's, inside it).
        raised = np.maximum(table.steady, above) - np.maximum(table.steady, self.above)
        table.low = np.where(raised > 0, table.low + raised, table.low)
        table.least_usd = table._least_usd()
        table.above = max(above, self.above)
        return table

    def subset(self, keep: np.ndarray) -> ConfigTable:
        table = ConfigTable.__new__(ConfigTable)
        index = np.flatnonzero(keep)
        table.configs = [self.configs[i] for i in index]
        table.n_blocks = self.n_blocks
        table.price = self.price
        table.gpipe = self.gpipe
        table.above = self.above
        for name in self.ARRAYS:
            setattr(table, name, getattr(self, name)[index])
        table.by_end = [np.flatnonzero(table.end == b) for b in range(self.n_blocks + 1)]
        table.by_first = [np.flatnonzero(table.first == b) for b in range(self.n_blocks + 1)]
        return table

    def least_paths(self, weights: np.ndarray, forward: bool) -> np.ndarray:
        """Shortest path lengths from boundary 0 to every boundary (forward), or from every boundary to
        the last (backward), over the configurations as edges weighted by `weights`."""
        return self._shortest(weights, forward)[0]

    def least_paths_of_rows(self, weights: np.ndarray, forward: bool) -> np.ndarray:
        """least_paths for each row of `weights` (rows x configurations) at once: rows x boundaries."""
        n_blocks = self.n_blocks
        best = np.full((weights.shape[0], n_blocks + 1), np.inf)
        if forward:
            best[:, 0] = 0.0
            order, incoming, source = range(1, n_blocks + 1), self.by_end, self.first
        else:
            best[:, n_blocks] = 0.0
            order, incoming, source = range(n_blocks - 1, -1, -1), self.by_first, self.end
        for b in order:
            edges = incoming[b]
            if len(edges):
                best[:, b] = (best[:, source[edges]] + weights[:, edges]).min(axis=1)
        return best

    def cheapest_path(self, weights: np.ndarray) -> list[int] | None:
        """The configurations of a shortest path from boundary 0 to the last (ties: the earliest);
        None when an infinite weight on every path leaves none."""
        best, via = self._shortest(weights, True)
        if not math.isfinite(best[self.n_blocks]):
            return None
        path, b = [], self.n_blocks
        while b > 0:
            path.append(int(via[b]))
            b = int(self.first[via[b]])
        return path[::-1]

    def _shortest(self, weights: np.ndarray, forward: bool) -> tuple[np.ndarray, np.ndarray]:
        """Path lengths, and the configuration each boundary is reached by on a shortest path."""
        n_blocks = self.n_blocks
        best = np.full(n_blocks + 1, np.inf)
        via = np.full(n_blocks + 1, -1)
        if forward:
            best[0] = 0.0
            order, incoming, source = range(1, n_blocks + 1), self.by_end, self.first
        else:
            best[n_blocks] = 0.0
            order, incoming, source = range(n_blocks - 1, -1, -1), self.by_first, self.end
        for b in order:
            edges = incoming[b]
            if len(edges):
                lengths = best[source[edges]] + weights[edges]
                k = int(np.argmin(lengths))
                best[b], via[b] = lengths[k], edges[k]
        return best, via


@dataclass
class Floors:
    """Per configuration, the least of a plan containing it: total GB of functions and fixed cost."""

    gb: np.ndarray
    fixed: np.ndarray
    #: and of the objective's primary measure (USD or seconds per iteration)
    least: np.ndarray


def heuristic_plan(
    problem: Problem,
    objective: Objective,
    mu: int,
    table: ConfigTable,
    deadline: float | None,
    budget: float | None,
) -> tuple[Solution, float] | None:
    """A good plan quickly, to prune by: for a cap on each stage's steady term (n - 1)(phi + beta)
    (or (n - 1) c under 1F1B), the cheapest path by the marginal value of each stage with the plan's
    time T and GB of functions G held fixed, price (GB_c T + G fill_c) + fixed_c (the fill alone for
    the time objectives), T and G updated from the closed-form model's evaluation of the path found.
    Only a start: the MILP proves (or improves on) it."""
    model = CostModel(problem)
    price = problem.region.prices.gb_second
    time_objective = Goal(objective).minimises_time
    levels = np.unique(table.steady)
    picks = sorted({round(k * (len(levels) - 1) / 15) for k in range(16)})
    best: tuple[Solution, float] | None = None
    tried: set[tuple[StageChoice, ...]] = set()
    for cap in levels[picks]:
        t_guess, gb_guess = float(cap), 0.0
        for _ in range(3):
            weight = (
                table.fill if time_objective else price * (table.gb * t_guess + gb_guess * table.fill) + table.fixed
            )
            capped = np.where(table.steady <= cap, weight, np.inf)
            # --stages N: a path of any length is no plan; the cheapest of N stages is
            path = (
                table.cheapest_path(capped)
                if problem.min_stages <= 1
                else cheapest_path_with_stages(
                    table.first, table.end, table.by_end, table.n_blocks, capped, problem.min_stages, problem.max_stages
                )
            )
            if path is None:
                break
            stages = tuple(table.configs[i][0] for i in path)
            if stages in tried:
                break
            tried.add(stages)
            plan = Plan(mu, stages)
            evaluation = model.evaluate(plan)
            if within_limits(problem, evaluation, deadline, budget):
                primary = objective_key(problem, objective, evaluation)[0]
                if best is None or primary < best[1]:
                    best = (Solution(plan, evaluation, primary, "feasible", math.inf, 0.0, "heuristic"), primary)
            t_guess, gb_guess = evaluation.iteration_s, float(table.gb[path].sum())
    return best


def prune(
    problem: Problem,
    objective: Objective,
    table: ConfigTable,
    *,
    deadline: float | None,
    budget: float | None,
    cutoff: float | None,
) -> tuple[ConfigTable, Floors]:
    """Exact reductions: drop every configuration that cannot be in a plan within the deadline and the
    budget that is better than a known plan (`cutoff`, e.g. the best baseline).

    In a plan, t >= T_s (ConfigTable.low) for each of its stages s, so its cost is at least the sum
    over its stages of w_s = price * GB_s * T_s + fixed_s, and also price * T_c * GB + fixed for any
    of its stages c. Over the paths from boundary 0 to c and from c to boundary B (shortest paths over
    the configurations still in), a plan with c costs at least the larger of
        w_before + w_c + w_after   and
        price * T_c * (GB_before + GB_c + GB_after) + fixed_before + fixed_c + fixed_after.
    Dropping configurations raises these floors, so the pass repeats until nothing changes."""
    price = problem.region.prices.gb_second
    slack = 1 + 1e-9
    goal = Goal(objective, deadline, budget)
    time_objective = goal.minimises_time
    while True:
        first, end = table.first, table.end
        least_gb = table.least_paths(table.gb, True)[first] + table.gb + table.least_paths(table.gb, False)[end]
        least_fixed = (
            table.least_paths(table.fixed, True)[first] + table.fixed + table.least_paths(table.fixed, False)[end]
        )
        weight = table.least_usd
        # A free platform's functions cost nothing alive (and 0 * inf, a configuration on no path, is no cost).
        alive = price * table.low * least_gb if price > 0 else np.zeros(len(table))
        least_cost = np.maximum(
            alive + least_fixed,
            table.least_paths(weight, True)[first] + weight + table.least_paths(weight, False)[end],
        )
        keep = np.isfinite(least_gb)
        if deadline is not None:
            keep &= table.low <= goal.time_limit(problem.iterations)
        if budget is not None:
            keep &= least_cost <= goal.cost_limit(problem.iterations)
        if cutoff is not None:
            keep &= (table.low if time_objective else least_cost) <= cutoff * slack
        if keep.all():
            return table, Floors(least_gb, least_fixed, table.low if time_objective else least_cost)
        table = table.subset(keep)
        if not len(table):
            return table, Floors(np.zeros(0), np.zeros(0), np.zeros(0))


def build_program(
    problem: Problem,
    objective: Objective,
    mu: int,
    table: ConfigTable,
    floors: Floors,
    *,
    deadline: float | None,
    budget: float | None,
    cutoff: float | None,
    above: float | None = None,
) -> StageProgram:
    """One MILP over stage configurations x_c (path-flow formulation), for micro-batch size mu.
    With `above`, only over the plans whose largest steady term exceeds it (a band, planner_bands).

    x_c = 1 when configuration c = (first block, last block, tier, replicas) is a stage. The chosen
    configurations form a path over block boundaries 0..B (flow conservation), so stages are
    contiguous and cover every block: for every block b exactly one chosen configuration covers it,
    sum_{c covers b} x_c = 1, which holds in the LP relaxation too. All per-stage terms are constants
    of c from the cost model. Each max term of the iteration time is bounded per covered block (a
    convex combination in the LP, far tighter than per stage), through running sums along the
    blocks that cost two nonzeros per configuration:

        t   >= sum_c (phi1_c + beta1_c) x_c + steady_f + W            (steady_f: GPipe only)
        steady_f >= F_b = sum_{c covers b} (n_c - 1) phi_c x_c         for every block b
        W   >= H_b + D_b,  D_b = sum_{c covers b} d_c x_c               d_c: the stage's drain
        H_b >= H_{b-1},  H_b >= U_b = sum_{c covers b} tail_c x_c - sum_{c ends before b} beta1_c x_c

    W is the drain plus the overhang, max over stages s <= s' of tail_s - (backward fill before s)
    + d_s' (docs/cost_model.md); H_b is the running max of the first part up to block b.

    The cost of keeping functions alive is sum_c price * GB_c * g_c with g_c = x_c * t, linearised
    exactly by a second flow (the flow conservation multiplied by t): g leaves boundary 0 with value
    t and is conserved at every boundary, with T_c x_c <= g_c <= T^max_c x_c (T_c, T^max_c: lower
    and upper bounds of t in a plan with c that can matter), so g_c = t on every chosen stage.
    """
    n_blocks = len(problem.blocks)
    n = len(table)
    gpipe = problem.schedule == "gpipe"
    prices = problem.region.prices
    slack = 1 + 1e-9
    goal = Goal(objective, deadline, budget)
    time_objective = goal.minimises_time
    configs = table.configs
    starting = [list(edges) for edges in table.by_first]
    ending = [list(edges) for edges in table.by_end]

    # An upper bound of any plan's iteration time: at most one stage starts at each block, and each
    # max term is at most its largest configuration value (the overhang at most the largest tail).
    t_max = (
        sum(float(table.fill[starting[b]].max()) if starting[b] else 0.0 for b in range(n_blocks))
        + (float(table.forward.max()) if gpipe else 0.0)
        + float(table.drain.max())
        + float(table.tail.max())
    )
    t_max = min(t_max, goal.time_limit(problem.iterations))

    program = Program()
    x = program.columns(n, 0.0, 1.0, integer=True)
    for b in range(n_blocks + 1):
        rhs = 1.0 if b == 0 else -1.0 if b == n_blocks else 0.0
        program.row([(x[i], 1.0) for i in starting[b]] + [(x[i], -1.0) for i in ending[b]], rhs, rhs)
    if problem.max_stages < n_blocks:
        program.row([(xi, 1.0) for xi in x], upper=problem.max_stages)
    if problem.min_stages > 1:
        program.row([(xi, 1.0) for xi in x], lower=problem.min_stages)
    if problem.function_limit < min(problem.max_stages, n_blocks) * max(problem.replicas):
        program.row([(x[i], float(c.replicas)) for i, (c, _, _) in enumerate(configs)], upper=problem.function_limit)

    def running_sum(enter: np.ndarray, leave: np.ndarray, lower: float = 0.0) -> list[int]:
        """Columns V_b = sum_{c covers b} enter_c x_c - sum_{c ends before b} (leave_c - enter_c) x_c
        for every block b, one equality per block: V_b = V_{b-1} + (enter at b) - (leave at b-1)."""
        v = program.columns(n_blocks, lower)
        for b in range(n_blocks):
            entries = [(v[b], 1.0)] + [(x[i], -float(enter[i])) for i in starting[b]]
            if b > 0:
                entries += [(v[b - 1], -1.0)] + [(x[i], float(leave[i])) for i in ending[b]]
            program.row(entries, 0.0, 0.0)
        return v

    if not gpipe:
        # A configuration that fits only with few stages after it (1F1B activations) limits them:
        # N_b counts the chosen stages that start at boundary b or later.
        count = program.columns(n_blocks + 1, 0.0, problem.max_stages)
        for b in range(n_blocks + 1):
            program.row(
                [(count[b], 1.0)]
                + [(x[i], -1.0) for i in starting[b]]
                + ([(count[b + 1], -1.0)] if b < n_blocks else []),
                0.0,
                0.0,
            )
        for i, (c, _, fits) in enumerate(configs):
            if fits < min(problem.max_stages, n_blocks - c.first) and c.last + 1 < n_blocks:
                big = problem.max_stages - fits + 1
                program.row([(count[c.last + 1], 1.0), (x[i], float(big))], upper=problem.max_stages)

    t_iter = program.column(0.0, t_max)
    pipeline = [(x[i], -float(table.fill[i])) for i in range(n)]
    if gpipe:
        steady_f = program.column()
        for v in running_sum(table.forward, table.forward):
            program.row([(steady_f, 1.0), (v, -1.0)], lower=0.0)
        pipeline.append((steady_f, -1.0))
    # W: the drain plus the overhang, max over stages s <= s' of tail_s - (backward fill before s) + d_s'.
    w = program.column()
    drains = running_sum(table.drain, table.drain)
    reach = running_sum(table.tail, table.tail + table.back_fill, -math.inf)
    peak = program.columns(n_blocks)
    for b in range(n_blocks):
        program.row([(peak[b], 1.0), (reach[b], -1.0)], lower=0.0)
        if b > 0:
            program.row([(peak[b], 1.0), (peak[b - 1], -1.0)], lower=0.0)
        program.row([(w, 1.0), (peak[b], -1.0), (drains[b], -1.0)], lower=0.0)
    pipeline.append((w, -1.0))
    program.row([(t_iter, 1.0)] + pipeline, lower=0.0)
    if above is not None:
        # Some stage's steady term exceeds `above`, and so do the max terms together (GPipe's largest
        # forwards and drain are at least any one stage's forwards and drain): the relaxation can no
        # longer spread the bottleneck over a mix of plans below it.
        program.row([(x[i], 1.0) for i in np.flatnonzero(table.steady > above)], lower=1.0)
        program.row([(w, 1.0)] + ([(steady_f, 1.0)] if gpipe else []), lower=above)

    g: list[int] = []
    g_low = np.zeros(0)
    g_high = np.zeros(0)
    cost: list[tuple[int, float]] = []  # micro-dollars (coefficients within a few orders of magnitude)
    if not time_objective or budget is not None:
        # Bounds of t in a plan with c worth considering: its cost must not exceed the cutoff or the
        # budget, with at least c's floors of GB and fixed cost (prune).
        limit = min(
            cutoff * slack if cutoff is not None and not time_objective else math.inf,
            goal.cost_limit(problem.iterations),
        )
        g = program.columns(n)
        for b in range(n_blocks + 1):
            source = [(t_iter, -1.0)] if b == 0 else [(t_iter, 1.0)] if b == n_blocks else []
            program.row([(g[i], 1.0) for i in starting[b]] + [(g[i], -1.0) for i in ending[b]] + source, 0.0, 0.0)
        g_low = table.low
        if prices.gb_second <= 0:
            g_high = np.full(n, t_max)
        else:
            with np.errstate(divide="ignore"):
                g_high = np.minimum(t_max, (limit - floors.fixed) / (prices.gb_second * floors.gb) * slack)
            g_high = np.maximum(g_high, g_low)
        for i in range(n):
            program.row([(g[i], 1.0), (x[i], -float(g_high[i]))], upper=0.0, group=i)
            program.row([(g[i], 1.0), (x[i], -float(g_low[i]))], lower=0.0, group=i)
        cost = [(g[i], 1e6 * prices.gb_second * float(table.gb[i])) for i in range(n)]
        cost += [(x[i], 1e6 * float(table.fixed[i])) for i in range(n)]
    goal.constrain(program, t_iter, cost, runs=problem.iterations, usd=1e6)
    return StageProgram(program, x, g, g_low, g_high, 1.0 if time_objective else 1e6)


def chosen_plan(table: ConfigTable, stage: StageProgram, values: list[float] | None, mu: int) -> Plan | None:
    """The plan a solver's values of `stage` choose. A solver in numerical trouble (coefficients many
    orders of magnitude apart) may return values that are no chain of stages: that answer is no plan."""
    if values is None:
        return None
    chosen = sorted((table.configs[i][0] for i in range(len(table)) if values[stage.x[i]] > 0.5), key=lambda c: c.first)
    return Plan(mu, tuple(chosen)) if _tiles(chosen, table.n_blocks) else None


def _tiles(stages: list[StageChoice], n_blocks: int) -> bool:
    """The stages (by first block) cover blocks 0..n_blocks-1 contiguously, each once."""
    end = 0
    for choice in stages:
        if choice.first != end or choice.last < choice.first:
            return False
        end = choice.last + 1
    return end == n_blocks and len(stages) > 0


def _indices(table: ConfigTable, plan: Plan) -> list[int]:
    """The table's positions of a plan's stages (those still in the table)."""
    where = {config[0]: i for i, config in enumerate(table.configs)}
    return [where[c] for c in plan.stages if c in where]
