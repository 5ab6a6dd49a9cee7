"""The joint pipeline plan as one MILP (HiGHS through highspy, else CBC through pulp): stages, block ranges,
memory tier and replicas per stage, for each candidate micro-batch size; the best over candidates is the plan.

The program chooses among stage configurations (block range x tier x replicas) whose terms come
straight from cost_model.py, so the MILP and the closed-form model cannot drift apart; the
optimum is checked against exhaustive search in the tests.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import pulp

from cloudless.compiler.cost_model import CostModel, Evaluation, Objective, Plan, Problem, StageChoice, StageTerms


@dataclass
class Solution:
    plan: Plan
    evaluation: Evaluation
    objective_value: float
    status: str
    gap: float
    solve_s: float
    solver: str
    candidates: dict[int, str] = field(default_factory=dict)


class Infeasible(Exception):
    """No plan satisfies the constraints; the message names the tightest bound."""


def objective_key(problem: Problem, objective: Objective, evaluation: Evaluation) -> tuple[float, float]:
    """What is minimised: (primary, tie-break)."""
    if objective in ("time", "time-under-budget"):
        return (evaluation.iteration_s, evaluation.cost_usd)
    return (evaluation.cost_usd, evaluation.iteration_s)


def within_limits(problem: Problem, evaluation: Evaluation, deadline: float | None, budget: float | None) -> bool:
    if not evaluation.feasible:
        return False
    if deadline is not None and evaluation.iteration_s * problem.iterations > deadline * (1 + 1e-9):
        return False
    return budget is None or evaluation.cost_usd * problem.iterations <= budget * (1 + 1e-9)


def solve(
    problem: Problem,
    objective: Objective = "cost",
    *,
    deadline: float | None = None,
    budget: float | None = None,
    time_limit: float | None = 60.0,
    fixed_ranges: list[tuple[int, int]] | None = None,
    incumbents: tuple[Plan, ...] = (),
) -> Solution:
    """The best plan over all candidate micro-batch sizes; raises Infeasible when none fits.

    `incumbents` (baseline plans) compete with the MILP's answer: when the solver stops at its time
    limit the result is never worse than them. The gap is measured against the solver's proven
    lower bound, which holds for every plan.
    """
    check_objective(objective, deadline, budget)
    start = time.perf_counter()
    model = CostModel(problem)
    found: list[Solution] = []
    bounds: list[float] = []
    statuses: dict[int, str] = {}
    solver_name = ""
    for plan in incumbents:
        evaluation = model.evaluate(plan)
        if within_limits(problem, evaluation, deadline, budget):
            value = objective_key(problem, objective, evaluation)[0]
            found.append(Solution(plan, evaluation, value, "incumbent", math.inf, 0.0, "baseline"))
    cutoff = min((sol.objective_value for sol in found), default=None)
    for mu in sorted(problem.micro_batch_counts()):
        solution, bound, status, name = solve_for_micro_batch(
            problem,
            objective,
            mu,
            deadline=deadline,
            budget=budget,
            time_limit=time_limit,
            fixed_ranges=fixed_ranges,
            cutoff=cutoff,
        )
        solver_name = name if name != "none" else solver_name
        statuses[mu] = status
        bounds.append(bound)
        if solution is not None:
            found.append(solution)
    if not found:
        raise Infeasible("no plan fits")
    best = min(found, key=lambda sol: objective_key(problem, objective, sol.evaluation))
    bound = min(bounds) if bounds else -math.inf
    gap = (best.objective_value - bound) / best.objective_value if best.objective_value > 0 else 0.0
    best.gap = 0.0 if gap < 1e-9 else gap  # below the solver's tolerance: proven optimal
    best.status = "optimal" if best.gap <= 1e-6 else "feasible"
    best.solve_s = time.perf_counter() - start
    best.solver = solver_name
    best.candidates = statuses
    return best


def check_objective(objective: Objective, deadline: float | None, budget: float | None) -> None:
    if objective == "cost-under-deadline" and deadline is None:
        raise ValueError("--objective cost-under-deadline needs --deadline SECONDS")
    if objective == "time-under-budget" and budget is None:
        raise ValueError("--objective time-under-budget needs --budget USD")


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
    configs = []
    spans = ranges if ranges is not None else [(a, b) for a in range(n_blocks) for b in range(a, n_blocks)]
    tiers = sorted(problem.region.tiers_mb, reverse=True)
    for first, last in spans:
        is_first, is_last = first == 0, last == n_blocks - 1
        # Stages from here to the end, this one included: 1 for the last, else as many as the
        # blocks left and the stage limit allow.
        most = 1 if is_last else min(n_blocks - first, limit if is_first else limit - 1)
        for r in problem.replicas:
            if r > problem.function_limit:
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

    def columns(self, count: int, lower: float = 0.0, upper: float = math.inf, integer: bool = False) -> list[int]:
        first = len(self.lower)
        self.lower.extend([lower] * count)
        self.upper.extend([upper] * count)
        self.cost.extend([0.0] * count)
        if integer:
            self.integer.extend(range(first, first + count))
        return list(range(first, first + count))

    def column(self, lower: float = 0.0, upper: float = math.inf) -> int:
        return self.columns(1, lower, upper)[0]

    def row(self, entries: list[tuple[int, float]], lower: float = -math.inf, upper: float = math.inf) -> None:
        for index, value in entries:
            if value:
                self.row_index.append(index)
                self.row_value.append(value)
        self.row_start.append(len(self.row_index))
        self.row_lower.append(lower)
        self.row_upper.append(upper)


@dataclass
class Outcome:
    values: list[float] | None  # a feasible solution, if found
    bound: float  # proven lower bound of the objective (inf when infeasible)
    status: str  # "optimal", "infeasible" or "time limit"
    solver: str


def run_program(program: Program, time_limit: float | None, cutoff: float | None = None) -> Outcome:
    """Solve with HiGHS (highspy) when installed, else CBC through pulp. `cutoff` is a known upper
    bound of the objective: the search may ignore solutions above it."""
    try:
        import highspy
    except ImportError:
        return _run_cbc(program, time_limit)
    import numpy as np

    inf = highspy.kHighsInf
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("mip_rel_gap", 1e-7)
    h.setOptionValue("threads", 1)
    # Probing the binaries in presolve (rule bit 15) and restarting after the root take most of the
    # time on these path programs and rarely pay off.
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
    h.run()
    status = h.getModelStatus()
    info = h.getInfo()
    has_solution = info.primal_solution_status == 2  # kSolutionStatusFeasible
    values = list(h.getSolution().col_value) if has_solution else None
    if status == highspy.HighsModelStatus.kOptimal:
        return Outcome(values, info.objective_function_value, "optimal", "HiGHS")
    if status in (highspy.HighsModelStatus.kInfeasible, highspy.HighsModelStatus.kObjectiveBound) and not has_solution:
        return Outcome(None, math.inf, "infeasible", "HiGHS")
    bound = info.mip_dual_bound if math.isfinite(info.mip_dual_bound) else -math.inf
    return Outcome(values, bound, "time limit", "HiGHS")


def _run_cbc(program: Program, time_limit: float | None) -> Outcome:
    lp = pulp.LpProblem("cloudless_plan", pulp.LpMinimize)
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
        expr = pulp.LpAffineExpression((columns[program.row_index[j]], program.row_value[j]) for j in range(start, end))
        if lo == up:
            lp += expr == lo
        else:
            if not math.isinf(lo):
                lp += expr >= lo
            if not math.isinf(up):
                lp += expr <= up
    lp.solve(pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit, gapRel=1e-7))
    status = pulp.LpStatus[lp.status]
    if status == "Infeasible":
        return Outcome(None, math.inf, "infeasible", "CBC")
    if lp.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        return Outcome(None, -math.inf, "time limit", "CBC")
    values = [v.value() or 0.0 for v in columns]
    optimal = status == "Optimal" and lp.sol_status == pulp.LpSolutionOptimal
    value = float(pulp.value(lp.objective) or 0.0)
    return Outcome(values, value if optimal else -math.inf, "optimal" if optimal else "time limit", "CBC")


def heuristic_plan(
    problem: Problem,
    objective: Objective,
    mu: int,
    configs: list[tuple[StageChoice, StageTerms, int]],
    deadline: float | None,
    budget: float | None,
) -> tuple[Solution, float] | None:
    """A good plan quickly, to prune by: for a cap on each stage's steady term (n - 1)(phi + beta)
    (or (n - 1) c under 1F1B), the cheapest path by the marginal value of each stage with the plan's
    time T and GB of functions G held fixed, price (GB_c T + G fill_c) + fixed_c (the fill alone for
    the time objectives), T and G updated from the closed-form model's evaluation of the path found.
    Only a start: the MILP proves (or improves on) it."""
    model = CostModel(problem)
    n_blocks = len(problem.blocks)
    per_replica = {r: math.ceil(problem.global_batch // mu / r) for r in problem.replicas}
    gpipe = problem.schedule == "gpipe"
    price = problem.region.prices.gb_second
    time_objective = objective in ("time", "time-under-budget")
    steady = [
        (per_replica[c.replicas] - 1) * (t.forward_s + t.backward_s if gpipe else t.cycle_s) for c, t, _ in configs
    ]
    fill = [t.forward_fill_s + t.backward_fill_s for _, t, _ in configs]
    gb = [c.replicas * c.tier_mb / 1024 for c, _, _ in configs]
    fixed = [model.request_usd(c) + model.storage_usd(t) for c, t, _ in configs]
    order = sorted(range(len(configs)), key=lambda i: configs[i][0].first)
    levels = sorted(set(steady))
    caps = sorted({levels[min(len(levels) - 1, round(k * (len(levels) - 1) / 15))] for k in range(16)})
    best: tuple[Solution, float] | None = None
    tried: set[tuple[StageChoice, ...]] = set()
    for cap in caps:
        t_guess, gb_guess = cap, 0.0
        for _ in range(3):
            weight = [
                fill[i] if time_objective else price * (gb[i] * t_guess + gb_guess * fill[i]) + fixed[i]
                for i in range(len(configs))
            ]
            value = [math.inf] * (n_blocks + 1)
            value[0] = 0.0
            previous = [-1] * (n_blocks + 1)
            for i in order:
                c = configs[i][0]
                if steady[i] <= cap and value[c.first] + weight[i] < value[c.last + 1]:
                    value[c.last + 1] = value[c.first] + weight[i]
                    previous[c.last + 1] = i
            if math.isinf(value[n_blocks]):
                break
            path, b = [], n_blocks
            while b > 0:
                path.append(previous[b])
                b = configs[previous[b]][0].first
            stages = tuple(configs[i][0] for i in reversed(path))
            if stages in tried:
                break
            tried.add(stages)
            plan = Plan(mu, stages)
            evaluation = model.evaluate(plan)
            if within_limits(problem, evaluation, deadline, budget):
                primary = objective_key(problem, objective, evaluation)[0]
                if best is None or primary < best[1]:
                    best = (Solution(plan, evaluation, primary, "feasible", math.inf, 0.0, "heuristic"), primary)
            t_guess, gb_guess = evaluation.iteration_s, sum(gb[i] for i in path)
    return best


def solve_for_micro_batch(
    problem: Problem,
    objective: Objective,
    mu: int,
    *,
    deadline: float | None = None,
    budget: float | None = None,
    time_limit: float | None = 60.0,
    fixed_ranges: list[tuple[int, int]] | None = None,
    cutoff: float | None = None,
) -> tuple[Solution | None, float, str, str]:
    """One MILP over stage configurations x_c (path-flow formulation), for micro-batch size mu.

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
    model = CostModel(problem)
    n_blocks = len(problem.blocks)
    M = problem.global_batch // mu
    configs = stage_configs(problem, mu, fixed_ranges)
    if objective == "time":
        # Exact reduction: on a larger tier a stage is never slower and holds no less, so for the
        # pure time objective only the largest fitting tier of each (range, replicas) can be optimal.
        largest: dict[tuple[int, int, int], tuple[StageChoice, StageTerms, int]] = {}
        for config in configs:
            c = config[0]
            key = (c.first, c.last, c.replicas)
            if key not in largest or c.tier_mb > largest[key][0].tier_mb:
                largest[key] = config
        configs = list(largest.values())
    per_replica = {r: math.ceil(M / r) for r in problem.replicas}
    gpipe = problem.schedule == "gpipe"

    # The blocks outside a stage still compute once each in the fill, at best on the fastest tier.
    fastest = min(model.kappa(m) for m in problem.region.tiers_mb) * mu / problem.profile_batch
    work = [b.forward_s + b.backward_s for b in problem.blocks]
    total_work = sum(work)
    prefix_work = [0.0]
    for w_b in work:
        prefix_work.append(prefix_work[-1] + w_b)

    def lower_bound(choice: StageChoice, terms: StageTerms) -> float:
        """Of the iteration time when the configuration is chosen (its tail may overlap others' work)."""
        steady = terms.forward_s + terms.backward_s if gpipe else terms.cycle_s
        rest = fastest * (total_work - (prefix_work[choice.last + 1] - prefix_work[choice.first]))
        return terms.forward_fill_s + terms.backward_fill_s + (per_replica[choice.replicas] - 1) * steady + rest

    prices = problem.region.prices
    slack = 1 + 1e-9
    floor = math.inf if cutoff is None else cutoff  # what the pruned plans are at least worth
    time_objective = objective in ("time", "time-under-budget")

    # Exact reductions: drop every configuration that cannot be in a plan within the deadline and the
    # budget that is better than a known plan (`cutoff`, e.g. the best baseline). In a plan, t >= T_s
    # for each of its stages s, so its cost is at least the sum over its stages of
    # w_s = price * GB_s * T_s + fixed_s, and also price * T_c * GB + fixed for any of its stages c.
    # Over the paths from boundary 0 to c and from c to boundary B (shortest paths over the
    # configurations still in), a plan with c costs at least the larger of
    #   w_before + w_c + w_after   and
    #   price * T_c * (GB_before + GB_c + GB_after) + fixed_before + fixed_c + fixed_after.
    # Dropping configurations raises these floors, so the pass repeats until nothing changes.
    def least_paths(configs: list[tuple[StageChoice, StageTerms, int]], weights: list[float], forward: bool):
        best = [math.inf] * (n_blocks + 1)
        best[0 if forward else n_blocks] = 0.0
        order = sorted(range(len(configs)), key=lambda i: configs[i][0].first if forward else -configs[i][0].last)
        for i in order:
            c = configs[i][0]
            here, there = (c.first, c.last + 1) if forward else (c.last + 1, c.first)
            best[there] = min(best[there], best[here] + weights[i])
        return best

    def prune(configs: list[tuple[StageChoice, StageTerms, int]], cutoff: float | None):
        while configs:
            gb = [c.replicas * c.tier_mb / 1024 for c, _, _ in configs]
            fixed = [model.request_usd(c) + model.storage_usd(t) for c, t, _ in configs]
            lows = [lower_bound(c, t) for c, t, _ in configs]
            gb_before, gb_after = least_paths(configs, gb, True), least_paths(configs, gb, False)
            fixed_before, fixed_after = least_paths(configs, fixed, True), least_paths(configs, fixed, False)
            least_gb = [gb_before[c.first] + gb[i] + gb_after[c.last + 1] for i, (c, _, _) in enumerate(configs)]
            least_fixed = [
                fixed_before[c.first] + fixed[i] + fixed_after[c.last + 1] for i, (c, _, _) in enumerate(configs)
            ]
            weight = [prices.gb_second * gb[i] * lows[i] + fixed[i] for i in range(len(configs))]
            w_before, w_after = least_paths(configs, weight, True), least_paths(configs, weight, False)
            least_cost = [
                max(
                    prices.gb_second * lows[i] * least_gb[i] + least_fixed[i],
                    w_before[c.first] + weight[i] + w_after[c.last + 1],
                )
                for i, (c, _, _) in enumerate(configs)
            ]
            least = lows if time_objective else least_cost
            keep = [
                i
                for i in range(len(configs))
                if (deadline is None or lows[i] * problem.iterations <= deadline * slack)
                and (budget is None or least_cost[i] * problem.iterations <= budget * slack)
                and (cutoff is None or least[i] <= cutoff * slack)
                and math.isfinite(least_gb[i])
            ]
            if len(keep) == len(configs):
                return configs, gb, fixed, lows, least_gb, least_fixed
            configs = [configs[i] for i in keep]
        return [], [], [], [], [], []

    configs, gb, fixed, lows, least_gb, least_fixed = prune(configs, cutoff)
    if not configs:
        return None, floor, "infeasible" if cutoff is None else "pruned", "none"
    # A good plan first (heuristic_plan), to prune by before the program is built.
    found = heuristic_plan(problem, objective, mu, configs, deadline, budget)
    if found is not None and (cutoff is None or found[1] < cutoff):
        cutoff = floor = found[1]
        configs, gb, fixed, lows, least_gb, least_fixed = prune(configs, cutoff)
        if not configs:
            found[0].status, found[0].gap = "optimal", 0.0
            return found[0], floor, "optimal", "none"

    n = len(configs)
    drain = [(per_replica[c.replicas] - 1) * (t.backward_s if gpipe else t.cycle_s) for c, t, _ in configs]
    starting: list[list[int]] = [[] for _ in range(n_blocks + 1)]
    ending: list[list[int]] = [[] for _ in range(n_blocks + 1)]  # by the boundary after the last block
    for i, (c, _, _) in enumerate(configs):
        starting[c.first].append(i)
        ending[c.last + 1].append(i)

    # An upper bound of any plan's iteration time: at most one stage starts at each block, and each
    # max term is at most its largest configuration value (the overhang at most the largest tail).
    t_max = (
        sum(
            max((configs[i][1].forward_fill_s + configs[i][1].backward_fill_s for i in starting[b]), default=0.0)
            for b in range(n_blocks)
        )
        + (max((per_replica[c.replicas] - 1) * t.forward_s for c, t, _ in configs) if gpipe else 0.0)
        + max(drain)
        + max(t.tail_s for _, t, _ in configs)
    )
    if deadline is not None:
        t_max = min(t_max, deadline / problem.iterations * slack)

    program = Program()
    x = program.columns(n, 0.0, 1.0, integer=True)
    for b in range(n_blocks + 1):
        rhs = 1.0 if b == 0 else -1.0 if b == n_blocks else 0.0
        program.row([(x[i], 1.0) for i in starting[b]] + [(x[i], -1.0) for i in ending[b]], rhs, rhs)
    if problem.max_stages < n_blocks:
        program.row([(xi, 1.0) for xi in x], upper=problem.max_stages)
    if problem.function_limit < min(problem.max_stages, n_blocks) * max(problem.replicas):
        program.row([(x[i], float(c.replicas)) for i, (c, _, _) in enumerate(configs)], upper=problem.function_limit)

    def running_sum(enter: list[float], leave: list[float], lower: float = 0.0) -> list[int]:
        """Columns V_b = sum_{c covers b} enter_c x_c - sum_{c ends before b} (leave_c - enter_c) x_c
        for every block b, one equality per block: V_b = V_{b-1} + (enter at b) - (leave at b-1)."""
        v = program.columns(n_blocks, lower)
        for b in range(n_blocks):
            entries = [(v[b], 1.0)] + [(x[i], -enter[i]) for i in starting[b]]
            if b > 0:
                entries += [(v[b - 1], -1.0)] + [(x[i], leave[i]) for i in ending[b]]
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
    pipeline = [(x[i], -(t.forward_fill_s + t.backward_fill_s)) for i, (_, t, _) in enumerate(configs)]
    if gpipe:
        steady_f = program.column()
        forward = [(per_replica[c.replicas] - 1) * t.forward_s for c, t, _ in configs]
        for v in running_sum(forward, forward):
            program.row([(steady_f, 1.0), (v, -1.0)], lower=0.0)
        pipeline.append((steady_f, -1.0))
    # W: the drain plus the overhang, max over stages s <= s' of tail_s - (backward fill before s) + d_s'.
    w = program.column()
    drains = running_sum(drain, drain)
    tails = [t.tail_s for _, t, _ in configs]
    reach = running_sum(tails, [tails[i] + configs[i][1].backward_fill_s for i in range(n)], -math.inf)
    peak = program.columns(n_blocks)
    for b in range(n_blocks):
        program.row([(peak[b], 1.0), (reach[b], -1.0)], lower=0.0)
        if b > 0:
            program.row([(peak[b], 1.0), (peak[b - 1], -1.0)], lower=0.0)
        program.row([(w, 1.0), (peak[b], -1.0), (drains[b], -1.0)], lower=0.0)
    pipeline.append((w, -1.0))
    program.row([(t_iter, 1.0)] + pipeline, lower=0.0)

    cost: list[tuple[int, float]] = []  # micro-dollars (coefficients within a few orders of magnitude)
    if not time_objective or budget is not None:
        # Bounds of t in a plan with c worth considering: its cost must not exceed the cutoff or the
        # budget, with at least c's floors of GB and fixed cost (above).
        limit = min(
            cutoff * slack if cutoff is not None and not time_objective else math.inf,
            budget / problem.iterations * slack if budget is not None else math.inf,
        )
        g = program.columns(n)
        for b in range(n_blocks + 1):
            rhs = [(t_iter, -1.0)] if b == 0 else [(t_iter, 1.0)] if b == n_blocks else []
            program.row([(g[i], 1.0) for i in starting[b]] + [(g[i], -1.0) for i in ending[b]] + rhs, 0.0, 0.0)
        for i in range(n):
            high = (
                t_max if prices.gb_second <= 0 else min(t_max, (limit - fixed[i]) / (prices.gb_second * gb[i]) * slack)
            )
            program.row([(g[i], 1.0), (x[i], -max(high, lows[i]))], upper=0.0)
            program.row([(g[i], 1.0), (x[i], -lows[i])], lower=0.0)
        cost = [(g[i], 1e6 * prices.gb_second * gb[i]) for i in range(n)] + [(x[i], 1e6 * fixed[i]) for i in range(n)]
    if budget is not None:
        program.row([(j, v * problem.iterations) for j, v in cost], upper=budget * 1e6)
    if objective in ("time", "time-under-budget"):
        program.cost[t_iter] = 1.0
        known = None if cutoff is None else cutoff * slack
    else:
        for j, v in cost:
            program.cost[j] += v
        known = None if cutoff is None else cutoff * 1e6 * slack

    outcome = run_program(program, time_limit, known)
    bound = outcome.bound
    if objective not in ("time", "time-under-budget"):
        bound /= 1e6  # micro-dollars
    bound = min(bound, floor)
    solution = None
    if outcome.values is not None:
        chosen = sorted((configs[i][0] for i in range(n) if outcome.values[x[i]] > 0.5), key=lambda c: c.first)
        plan = Plan(mu, tuple(chosen))
        evaluation = model.evaluate(plan)
        primary = objective_key(problem, objective, evaluation)[0]
        solution = Solution(plan, evaluation, primary, "", 0.0, 0.0, outcome.solver)
    # HiGHS may return a plan above the cutoff it was given: the heuristic's plan is then the better.
    if found is not None and (solution is None or found[1] <= solution.objective_value):
        solution = found[0]
        solution.solver = outcome.solver
    if solution is None:
        if outcome.status == "infeasible":
            return None, bound, "infeasible" if cutoff is None else "pruned", outcome.solver
        return None, bound, "no solution in time", outcome.solver
    # Judge by the bound: a time-limited run may hold a plan that is optimal without proof.
    primary = solution.objective_value
    gap = (primary - bound) / primary if primary > 0 else 0.0
    proven = gap <= 1e-6
    solution.status, solution.gap = "optimal" if proven else "feasible", max(gap, 0.0)
    return solution, bound, "optimal" if proven else "time limit", outcome.solver
