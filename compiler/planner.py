"""The joint pipeline plan as one MILP (pulp; HiGHS, else CBC): stages, block ranges, memory tier and
replicas per stage, for each candidate micro-batch size; the best over candidates is the plan.

The program chooses among stage configurations (block range x tier x replicas) whose terms come
straight from cost_model.py, so the MILP and the closed-form model cannot drift apart; the
optimum is checked against exhaustive search in the tests.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
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


def choose_solver(time_limit: float | None) -> tuple[pulp.LpSolver, str]:
    if pulp.HiGHS().available():
        return pulp.HiGHS(msg=False, timeLimit=time_limit, gapRel=1e-7, threads=1), "HiGHS"
    return pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit, gapRel=1e-7), "CBC"


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
    `ranges` restricts the block ranges considered (a fixed partition)."""
    model = CostModel(problem)
    n_blocks = len(problem.blocks)
    limit = min(problem.max_stages, n_blocks)
    configs = []
    spans = ranges if ranges is not None else [(a, b) for a in range(n_blocks) for b in range(a, n_blocks)]
    for first, last in spans:
        for m in problem.region.tiers_mb:
            for r in problem.replicas:
                if r > problem.function_limit:
                    continue
                choice = StageChoice(first, last, m, r)
                is_first, is_last = first == 0, last == n_blocks - 1
                # Stages from here to the end, this one included: 1 for the last, else as many as
                # the blocks left and the stage limit allow.
                most = 1 if is_last else min(n_blocks - first, limit if is_first else limit - 1)
                fits = 0
                for depth in range(1, most + 1):
                    terms = model.config_terms(choice, is_first, is_last, depth, mu)
                    if terms.memory_mb > m:
                        break
                    fits = depth
                    if problem.schedule == "gpipe":
                        fits = most  # GPipe memory does not depend on the depth
                        break
                if fits:
                    configs.append((choice, model.config_terms(choice, is_first, is_last, 1, mu), fits))
    return configs


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
    contiguous and cover every block. All per-stage terms are constants of c from the cost model;
    the iteration time t = sum_c (phi1_c + beta1_c) x_c + steady + overhang (docs/cost_model.md),
    with each max term bounded below per boundary; the cost of keeping functions alive is
    sum_c price * GB_c * g_c with g_c = x_c * t, linearised exactly:
    g_c >= t - T_max (1 - x_c), g_c >= T_c x_c (T_c: a lower bound of t when c is chosen), g_c >= 0.
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

    def least_cost(choice: StageChoice, terms: StageTerms) -> float:
        """Of any plan with the configuration: its functions alive for at least T_c, its requests."""
        compute = prices.gb_second * choice.replicas * choice.tier_mb / 1024 * lower_bound(choice, terms)
        return compute + model.request_usd(choice) + model.storage_usd(terms)

    # Exact reductions: drop every configuration that alone breaks the deadline or the budget, or
    # whose least value is no better than a known plan's (`cutoff`, e.g. the best baseline).
    slack = 1 + 1e-9
    least = lower_bound if objective in ("time", "time-under-budget") else least_cost
    configs = [
        (c, t, fits)
        for c, t, fits in configs
        if (deadline is None or lower_bound(c, t) * problem.iterations <= deadline * slack)
        and (budget is None or least_cost(c, t) * problem.iterations <= budget * slack)
        and (cutoff is None or least(c, t) <= cutoff * slack)
    ]
    floor = math.inf if cutoff is None else cutoff  # what the pruned plans are at least worth
    if not configs:
        return None, floor, "infeasible" if cutoff is None else "pruned", "none"

    # An upper bound of any plan's iteration time: at most one stage starts at each block, and each
    # max term is at most its largest configuration value.
    t_max = (
        sum(
            max((t.forward_fill_s + t.backward_fill_s for c, t, _ in configs if c.first == b), default=0.0)
            for b in range(n_blocks)
        )
        + max((per_replica[c.replicas] - 1) * (t.forward_s + t.backward_s) for c, t, _ in configs)
        + max(t.tail_s for _, t, _ in configs)
    )

    lp = pulp.LpProblem("cloudless_plan", pulp.LpMinimize)
    x = [pulp.LpVariable(f"x_{i}", cat="Binary") for i in range(len(configs))]
    starting: dict[int, list[int]] = {}
    ending: dict[int, list[int]] = {}
    for i, (c, _, _) in enumerate(configs):
        starting.setdefault(c.first, []).append(i)
        ending.setdefault(c.last + 1, []).append(i)
    for boundary in range(n_blocks + 1):
        out_flow = pulp.lpSum(x[i] for i in starting.get(boundary, []))
        in_flow = pulp.lpSum(x[i] for i in ending.get(boundary, []))
        lp += out_flow - in_flow == (1 if boundary == 0 else -1 if boundary == n_blocks else 0)
    lp += pulp.lpSum(x) <= problem.max_stages
    lp += pulp.lpSum(c.replicas * x[i] for i, (c, _, _) in enumerate(configs)) <= problem.function_limit
    if not gpipe:
        # A configuration that fits only with few stages after it (1F1B activations) limits them.
        after_boundary = {
            b: pulp.lpSum(x[i] for i, (c, _, _) in enumerate(configs) if c.first >= b) for b in range(n_blocks + 1)
        }
        for i, (c, _, fits) in enumerate(configs):
            if fits < min(problem.max_stages, n_blocks - c.first):
                lp += after_boundary[c.last + 1] + 1 <= fits + problem.max_stages * (1 - x[i])

    t_iter = pulp.LpVariable("t_iter", lowBound=0)
    fill = pulp.lpSum((t.forward_fill_s + t.backward_fill_s) * x[i] for i, (_, t, _) in enumerate(configs))
    # At most one stage starts at each boundary, so each max term is bounded below by the sum over
    # the configurations starting there (tighter than one row per configuration, and fewer rows).
    steady_terms: list[tuple[str, Callable[[StageTerms], float]]] = (
        [("steady_f", lambda t: t.forward_s), ("steady_b", lambda t: t.backward_s)]
        if gpipe
        else [("steady", lambda t: t.cycle_s)]
    )
    steady = []
    for name, term in steady_terms:
        var = pulp.LpVariable(name, lowBound=0)
        steady.append(var)
        for members in starting.values():
            row = [((per_replica[configs[i][0].replicas] - 1) * term(configs[i][1]), x[i]) for i in members]
            if any(coef for coef, _ in row):
                lp += var >= pulp.lpSum(coef * xi for coef, xi in row)
    # Each stage syncs and steps once its last backward is done, while the stages before it still
    # run theirs and the drain of the busiest stage at or after it has passed (cost_model.evaluate).
    # Along the chosen path, with D the drain term (steady_b, or the 1F1B steady term):
    #   A_f = max(d_c, A_{l+1})                      the largest drain d_c = (n_c - 1) beta_c from f on
    #   E_f = max(0, tail_c + A_f - D, E_{l+1} - bfill_c)   how long the tails outlast the pipeline
    # as big-M rows, exact at integer points; the iteration ends E_0 after the pipeline.
    drain_var = steady[-1]
    drain_term = steady_terms[-1][1]
    drains = [(per_replica[c.replicas] - 1) * drain_term(t) for c, t, _ in configs]
    drain_bound = max(drains)
    tail_bound = max(t.tail_s for _, t, _ in configs)
    later_drain = [pulp.LpVariable(f"a_{b}", lowBound=0) for b in range(n_blocks + 1)]
    overhang = [pulp.LpVariable(f"e_{b}", lowBound=0) for b in range(n_blocks + 1)]
    for b, members in starting.items():
        lp += later_drain[b] >= pulp.lpSum(drains[i] * x[i] for i in members)
        lp += overhang[b] >= pulp.lpSum(configs[i][1].tail_s * x[i] for i in members) + later_drain[b] - drain_var
    for i, (c, t, _) in enumerate(configs):
        if c.last + 1 < n_blocks:
            lp += later_drain[c.first] >= later_drain[c.last + 1] - drain_bound * (1 - x[i])
            lp += overhang[c.first] >= overhang[c.last + 1] - t.backward_fill_s - tail_bound * (1 - x[i])
    lp += t_iter >= fill + pulp.lpSum(steady) + overhang[0]

    # Cost in micro-dollars (keeps coefficients within a few orders of magnitude for the solver).
    g = [pulp.LpVariable(f"g_{i}", lowBound=0) for i in range(len(configs))]
    for i, (c, t, _) in enumerate(configs):
        lp += g[i] >= t_iter - t_max * (1 - x[i])
        lp += g[i] >= lower_bound(c, t) * x[i]
    compute = (
        1e6 * prices.gb_second * pulp.lpSum(c.replicas * c.tier_mb / 1024 * g[i] for i, (c, _, _) in enumerate(configs))
    )
    fixed = pulp.lpSum(
        1e6 * (model.request_usd(c) + model.storage_usd(t)) * x[i] for i, (c, t, _) in enumerate(configs)
    )
    cost = compute + fixed
    if deadline is not None:
        lp += t_iter * problem.iterations <= deadline
    if budget is not None:
        lp += cost * problem.iterations <= budget * 1e6
    lp += t_iter if objective in ("time", "time-under-budget") else cost

    solver, solver_name = choose_solver(time_limit)
    started = time.perf_counter()
    lp.solve(solver)
    solve_s = time.perf_counter() - started
    status = pulp.LpStatus[lp.status]
    bound = _lower_bound(lp, solver_name, status)
    if objective not in ("time", "time-under-budget"):
        bound /= 1e6  # micro-dollars
    bound = min(bound, floor)
    if not _has_solution(lp):
        if status == "Infeasible":
            return None, bound, "infeasible" if cutoff is None else "pruned", solver_name
        return None, bound, "no solution in time", solver_name
    chosen = sorted((configs[i][0] for i in range(len(configs)) if (x[i].value() or 0) > 0.5), key=lambda c: c.first)
    plan = Plan(mu, tuple(chosen))
    evaluation = model.evaluate(plan)
    primary = objective_key(problem, objective, evaluation)[0]
    # pulp reports a time-limited HiGHS run that has a solution as "Optimal": judge by the bound.
    gap = (primary - bound) / primary if primary > 0 else 0.0
    proven = gap <= 1e-6
    solution = Solution(
        plan, evaluation, primary, "optimal" if proven else "feasible", max(gap, 0.0), solve_s, solver_name
    )
    return solution, bound, "optimal" if proven else "time limit", solver_name


def _has_solution(lp: pulp.LpProblem) -> bool:
    return lp.sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible)


def _lower_bound(lp: pulp.LpProblem, solver_name: str, status: str) -> float:
    """The solver's proven lower bound of the objective (inf when proven infeasible)."""
    if status == "Infeasible":
        return math.inf
    if solver_name == "HiGHS":
        try:
            info = lp.solverModel.getInfo()
            if info.mip_node_count >= 0 and math.isfinite(info.mip_dual_bound):
                return float(info.mip_dual_bound)
        except Exception:  # noqa: BLE001 - older highspy: fall back to the status below
            pass
    if status == "Optimal":
        return float(pulp.value(lp.objective))
    return -math.inf
