"""The joint pipeline plan as one MILP (solver.py: HiGHS, else CBC): stages, block ranges,
memory tier and replicas per stage, for each candidate micro-batch size; the best over candidates is the plan.

The program chooses among stage configurations (block range x tier x replicas) whose terms come
straight from cost_model.py, so the MILP and the closed-form model cannot drift apart; the
optimum is checked against exhaustive search in the tests.

Per micro-batch size (solve_for_micro_batch), top to bottom, with pipeline_program.py's pieces: stage_configs
-> ConfigTable -> prune (path floors against the best known plan) -> heuristic_plan (a cutoff) ->
build_program -> on large programs price_configurations (pricing.py: the LP relaxation by column generation,
then reduced-cost fixing) -> solver.solve_program (the MILP over what is left). Programs of more than
BAND_FROM_CONFIGS configurations are searched by bands of their bottleneck instead (bands.search_bands), each
band a small MILP.
"""

from __future__ import annotations

import math
import time

import numpy as np

from .bands import search_bands
from .cost_model import CostModel, Objective, Plan, Problem, StageChoice, StageTerms
from .pipeline_program import (
    SEEDS_PER_BLOCK,
    ConfigTable,
    Infeasible,
    OutOfTime,
    Solution,
    _indices,
    build_program,
    check_objective,
    chosen_plan,
    heuristic_plan,
    objective_key,
    prune,
    stage_configs,
    within_limits,
)
from .pricing import price_configurations
from .solver import CandidateStatus, Goal, SolveStatus, solve_program

# Reduced-cost fixing (price_configurations) pays off on large programs; it may take this share of the
# time limit, the MILP the rest.
PRICE_FROM_CONFIGS = 1500
#: Larger programs are searched by bands of their bottleneck instead (bands.py): their relaxation
#: is too weak for HiGHS to close the gap in time (a Llama-3-8B shape's 850 configurations: one MILP
#: stops at 10 s 3-5 % from proven, its bands are proven optimal in 2 s).
BAND_FROM_CONFIGS = 500
PRICE_SHARE = 0.6


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
    statuses: dict[int, CandidateStatus] = {}
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
        if "no solution in time" in statuses.values():
            raise OutOfTime("the solver found no plan within its time limit")
        raise Infeasible("no plan fits")
    best = min(found, key=lambda sol: objective_key(problem, objective, sol.evaluation))
    bound = min(bounds) if bounds else -math.inf
    gap = (best.objective_value - bound) / best.objective_value if best.objective_value > 0 else 0.0
    if bound <= 0 < best.objective_value:
        gap = math.inf  # no useful bound (a solver stopped before it had one)
    best.gap = 0.0 if gap < 1e-9 else gap  # below the solver's tolerance: proven optimal
    best.status = "optimal" if best.gap <= 1e-6 else "feasible"
    best.solve_s = time.perf_counter() - start
    best.solver = solver_name
    best.candidates = statuses
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
) -> tuple[Solution | None, float, CandidateStatus, str]:
    """The best plan for micro-batch size mu (build_program's MILP), with its proven lower bound.

    Before the MILP: exact pruning by path floors (prune), a heuristic plan as the cutoff, and, on
    large programs, reduced-cost fixing from the LP relaxation (price_configurations)."""
    start = time.perf_counter()
    model = CostModel(problem)
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
    floor = math.inf if cutoff is None else cutoff  # what the pruned plans are at least worth
    limits = {"deadline": deadline, "budget": budget}
    table, floors = prune(problem, objective, ConfigTable(problem, mu, configs), cutoff=cutoff, **limits)
    if not len(table):
        return None, floor, "infeasible" if cutoff is None else "pruned", "none"
    # A good plan first (heuristic_plan), to prune by before the program is built.
    found = heuristic_plan(problem, objective, mu, table, deadline, budget)
    if found is not None and (cutoff is None or found[1] < cutoff):
        cutoff = floor = found[1]
        table, floors = prune(problem, objective, table, cutoff=cutoff, **limits)
        if not len(table):
            found[0].status, found[0].gap = "optimal", 0.0
            return found[0], floor, "optimal", "none"
    if len(table) > BAND_FROM_CONFIGS:
        stop_at = math.inf if time_limit is None else start + time_limit
        incumbent = None if found is None else found[0]
        search = search_bands(
            problem, objective, mu, table, incumbent, cutoff, deadline=deadline, budget=budget, stop_at=stop_at
        )
        return _answer(search.solution, search.bound, floor, search.status, search.solver, pruning=cutoff is not None)

    stage = build_program(problem, objective, mu, table, floors, cutoff=cutoff, **limits)
    relaxed = -math.inf  # the LP relaxation's proven bound, objective units
    if cutoff is not None and len(table) > PRICE_FROM_CONFIGS and found is not None:
        # Reduced-cost fixing: the LP bounds every configuration's plans; those above the known plan go.
        budget_s = PRICE_SHARE * time_limit if time_limit is not None else math.inf
        # Start from the heuristic's plan and, from each block, the stages with the least floor weight.
        weight = table.low if Goal(objective).minimises_time else table.least_usd
        seeds = _indices(table, found[0].plan)
        for edges in table.by_first:
            seeds.extend(int(i) for i in edges[np.argsort(weight[edges], kind="stable")[:SEEDS_PER_BLOCK]])
        pricing = price_configurations(stage, seeds, start + budget_s)

        if pricing is not None:
            relaxed = pricing.bound / stage.scale
            known = cutoff * stage.scale * (1 + 1e-9)
            keep = pricing.with_config <= known + 1e-9 * abs(known)
            if not keep.all():
                table, floors = prune(problem, objective, table.subset(keep), cutoff=cutoff, **limits)
                if not len(table):
                    found[0].status, found[0].gap = "optimal", 0.0
                    return found[0], floor, "optimal", "HiGHS"
                stage = build_program(problem, objective, mu, table, floors, cutoff=cutoff, **limits)
    remaining = None if time_limit is None else max(0.5, time_limit - (time.perf_counter() - start))
    objective_bound = None if cutoff is None else cutoff * stage.scale * (1 + 1e-9)
    outcome = solve_program(stage.program, remaining, objective_bound)
    # Plans outside the program are worth at least the cutoff (pruned or fixed), and every plan at
    # least the LP's bound.
    bound = max(min(outcome.bound / stage.scale, floor), relaxed)
    solution = None
    plan = chosen_plan(table, stage, outcome.values, mu)
    if plan is not None:
        evaluation = model.evaluate(plan)
        primary = objective_key(problem, objective, evaluation)[0]
        solution = Solution(plan, evaluation, primary, "", 0.0, 0.0, outcome.solver)
    # HiGHS may return a plan above the cutoff it was given: the heuristic's plan is then the better.
    if found is not None and (solution is None or found[1] <= solution.objective_value):
        solution = found[0]
        solution.solver = outcome.solver
    return _answer(solution, bound, floor, outcome.status, outcome.solver, pruning=cutoff is not None)


def _answer(
    solution: Solution | None, bound: float, floor: float, status: SolveStatus, solver: str, *, pruning: bool
) -> tuple[Solution | None, float, CandidateStatus, str]:
    """What solve_for_micro_batch returns for the best plan found (if any), the proven `bound`, the
    value `floor` the pruned plans are at least worth and the solver's `status`."""
    if solution is None:
        if status == "infeasible":
            return None, bound, "pruned" if pruning else "infeasible", solver
        return None, bound, "no solution in time", solver
    if solution.objective_value > floor * (1 + 1e-9) and bound >= floor * (1 - 1e-9):
        # Proven not to beat the plan known from elsewhere (HiGHS may still return a worse one).
        return None, bound, "pruned", solver
    # Judge by the bound: a time-limited run may hold a plan that is optimal without proof.
    primary = solution.objective_value
    gap = (primary - bound) / primary if primary > 0 else 0.0
    if bound <= 0 < primary:
        gap = math.inf  # a bound that says nothing (the LP stopped early)
    proven = gap <= 1e-6
    solution.status, solution.gap = "optimal" if proven else "feasible", max(gap, 0.0)
    return solution, bound, "optimal" if proven else "time limit", solver
