"""The joint pipeline plan as one MILP (pulp; HiGHS, else CBC): stages, block ranges, memory tier and
replicas per stage, for each candidate micro-batch size; the best over candidates is the plan.

Variables (per micro-batch size mu, with M = global_batch / mu micro-batches):
  z[b,s]    block b is in stage s (binary); stage(b) = sum_s s*z[b,s] is 0 at b=0 and rises by 0 or 1
            per block, so stages are contiguous and non-empty; e_s = sum_{s'>=s} z[B-1,s'] marks used stages
  q[s,m,r]  stage s runs on tier m with r replicas (binary, one per used stage)
  phi_s, beta_s, sync_s, upd_s, Phi*, t   continuous times; g[s,m,r] = q[s,m,r] * t (cost of being alive)
Every product of a binary choice and a continuous quantity is linearised exactly with bounded
big-M constraints, so the optimum equals that of the closed-form model in cost_model.py (checked
against exhaustive search in tests).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import pulp

from cloudless.compiler.cost_model import MB, CostModel, Evaluation, Objective, Plan, Problem, StageChoice


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
) -> Solution:
    """The optimal plan over all candidate micro-batch sizes; raises Infeasible when none fits."""
    _check_objective(objective, deadline, budget)
    start = time.perf_counter()
    best: Solution | None = None
    statuses: dict[int, str] = {}
    for mu in sorted(problem.micro_batch_counts()):
        solution = solve_for_micro_batch(
            problem, objective, mu, deadline=deadline, budget=budget, time_limit=time_limit, fixed_ranges=fixed_ranges
        )
        statuses[mu] = solution.status if solution else "infeasible"
        if solution is None:
            continue
        if best is None or objective_key(problem, objective, solution.evaluation) < objective_key(
            problem, objective, best.evaluation
        ):
            best = solution
    if best is None:
        raise Infeasible("no plan fits")
    best.solve_s = time.perf_counter() - start
    best.candidates = statuses
    return best


def _check_objective(objective: Objective, deadline: float | None, budget: float | None) -> None:
    if objective == "cost-under-deadline" and deadline is None:
        raise ValueError("objective cost-under-deadline needs --deadline")
    if objective == "time-under-budget" and budget is None:
        raise ValueError("objective time-under-budget needs --budget")


def solve_for_micro_batch(
    problem: Problem,
    objective: Objective,
    mu: int,
    *,
    deadline: float | None = None,
    budget: float | None = None,
    time_limit: float | None = 60.0,
    fixed_ranges: list[tuple[int, int]] | None = None,
) -> Solution | None:
    model = CostModel(problem)
    region = problem.region
    blocks = problem.blocks
    n_blocks = len(blocks)
    n_stages = min(problem.max_stages, n_blocks)
    tiers = region.tiers_mb
    replicas = problem.replicas
    M = problem.global_batch // mu
    sigma = mu / problem.profile_batch
    k = problem.optimizer_state
    L = model.latency
    # Units inside the program: MiB, MiB/s, seconds and micro-dollars, so that coefficients stay
    # within a few orders of magnitude (raw bytes beside seconds make HiGHS misjudge feasibility).
    kappa = {m: model.kappa(m) for m in tiers}
    bandwidth = {m: model.bandwidth(m) / MB for m in tiers}
    update_rate = {m: model.update_rate(m) / MB for m in tiers}
    in_mb = [b.input_bytes / MB for b in blocks]
    out_mb = [b.output_bytes / MB for b in blocks]
    param_mb = [b.param_bytes / MB for b in blocks]
    saved_mb = [b.saved_bytes / MB for b in blocks]
    buffer_mb = [b.buffer_bytes / MB for b in blocks]
    shared_mb = {name: size / MB for name, size in problem.shared_bytes.items()}
    per_replica = {r: math.ceil(M / r) for r in replicas}

    # Bounds for the big-M constants, from the slowest tier and the largest quantities.
    kappa_max = max(kappa.values())
    bw_min = min(bandwidth.values())
    sum_f = sigma * sum(b.forward_s for b in blocks)
    sum_g = sigma * sum(b.backward_s for b in blocks)
    max_bytes = sigma * max(max(in_mb), max(out_mb))
    total_params = sum(param_mb) + sum(shared_mb.values())
    big_f = kappa_max * sum_f + max_bytes / bw_min + L
    big_g = kappa_max * sum_g + max_bytes / bw_min + L
    big_sync = 2 * total_params / bw_min + 2 * max(replicas) * L
    big_upd = (2 + k) * total_params / min(update_rate.values())
    big_t = n_stages * (big_f + big_g) + max(per_replica.values()) * (big_f + big_g) + big_sync + big_upd
    big_mem = region.runtime_overhead_mb + (
        (2 + k) * total_params
        + sum(buffer_mb)
        + sigma * sum(saved_mb) * max(per_replica.values())
        + 4 * max_bytes
    )

    lp = pulp.LpProblem("cloudless_plan", pulp.LpMinimize)
    S = range(n_stages)
    z = {
        (b, s): pulp.LpVariable(f"z_{b}_{s}", cat="Binary")
        for b in range(n_blocks)
        for s in S
        if s <= b
    }
    q = {(s, m, r): pulp.LpVariable(f"q_{s}_{m}_{r}", cat="Binary") for s in S for m in tiers for r in replicas}

    def zz(b: int, s: int) -> pulp.LpAffineExpression | int:
        return z.get((b, s), 0)

    stage_of = {b: pulp.lpSum(s * zz(b, s) for s in S) for b in range(n_blocks)}
    for b in range(n_blocks):
        lp += pulp.lpSum(zz(b, s) for s in S) == 1
    lp += z[(0, 0)] == 1
    for b in range(n_blocks - 1):
        lp += stage_of[b + 1] >= stage_of[b]
        lp += stage_of[b + 1] <= stage_of[b] + 1
    used = {s: pulp.lpSum(zz(n_blocks - 1, t) for t in S if t >= s) for s in S}
    stage_count = pulp.lpSum(used[s] for s in S)
    if fixed_ranges is not None:
        for s, (first, last) in enumerate(fixed_ranges):
            for b in range(first, last + 1):
                lp += zz(b, s) == 1

    for s in S:
        lp += pulp.lpSum(q[(s, m, r)] for m in tiers for r in replicas) == used[s]
    y = {(s, m): pulp.lpSum(q[(s, m, r)] for r in replicas) for s in S for m in tiers}
    v = {(s, r): pulp.lpSum(q[(s, m, r)] for m in tiers) for s in S for r in replicas}

    # Stage sums (linear in z).
    SF = {s: pulp.lpSum(b_.forward_s * zz(b, s) for b, b_ in enumerate(blocks)) for s in S}
    SG = {s: pulp.lpSum(b_.backward_s * zz(b, s) for b, b_ in enumerate(blocks)) for s in S}
    SA = {s: pulp.lpSum(saved_mb[b] * zz(b, s) for b in range(n_blocks)) for s in S}
    SB = {s: pulp.lpSum(buffer_mb[b] * zz(b, s) for b in range(n_blocks)) for s in S}
    holds = {}
    for name, size in sorted(shared_mb.items()):
        users = [b for b, b_ in enumerate(blocks) if name in b_.shared]
        for s in S:
            h = pulp.LpVariable(f"h_{len(holds)}", lowBound=0, upBound=1)
            for b in users:
                if (b, s) in z:
                    lp += h >= z[(b, s)]
            holds[(name, s)] = (h, size)
    SP = {
        s: pulp.lpSum(param_mb[b] * zz(b, s) for b in range(n_blocks))
        + pulp.lpSum(size * h for (name, t), (h, size) in holds.items() if t == s)
        for s in S
    }
    # Bytes entering (IN) and leaving (OUT) each stage: the first and last block's boundaries.
    IN, OUT = {}, {}
    for s in S:
        terms = [in_mb[0] * zz(0, s)]
        for b in range(1, n_blocks):
            if (b, s) in z:
                start = pulp.LpVariable(f"start_{b}_{s}", lowBound=0)
                lp += start >= z[(b, s)] - zz(b - 1, s)
                terms.append(in_mb[b] * start)
        IN[s] = pulp.lpSum(terms)
        terms = []
        for b in range(n_blocks - 1):
            if (b, s) in z:
                end = pulp.LpVariable(f"end_{b}_{s}", lowBound=0)
                lp += end >= z[(b, s)] - zz(b + 1, s)
                terms.append(out_mb[b] * end)
        OUT[s] = pulp.lpSum(terms)

    phi = {s: pulp.LpVariable(f"phi_{s}", lowBound=0) for s in S}
    beta = {s: pulp.LpVariable(f"beta_{s}", lowBound=0) for s in S}
    sync = {s: pulp.LpVariable(f"sync_{s}", lowBound=0) for s in S}
    upd = {s: pulp.LpVariable(f"upd_{s}", lowBound=0) for s in S}
    more_than_one = used[1] if n_stages > 1 else 0
    for s in S:
        for m in tiers:
            off_f = big_f * (1 - y[(s, m)])
            off_g = big_g * (1 - y[(s, m)])
            lp += phi[s] >= sigma * kappa[m] * SF[s] - off_f
            lp += phi[s] >= sigma * IN[s] / bandwidth[m] + L * used[s] - off_f
            lp += phi[s] >= sigma * OUT[s] / bandwidth[m] + L * used[s] - off_f
            lp += beta[s] >= sigma * kappa[m] * SG[s] - off_g
            lp += beta[s] >= sigma * OUT[s] / bandwidth[m] + L * more_than_one - off_g
            if s > 0:
                lp += beta[s] >= sigma * IN[s] / bandwidth[m] + L * more_than_one - off_g
            lp += upd[s] >= (2 + k) * SP[s] / update_rate[m] - big_upd * (1 - y[(s, m)])
            for r in replicas:
                if r > 1:
                    lp += sync[s] >= model.sync_factor(r) * SP[s] / bandwidth[m] + 2 * (r - 1) * L - big_sync * (
                        1 - q[(s, m, r)]
                    )

    # Memory: one constraint per (stage, tier, replicas); 1F1B holds min(per_replica, stages left).
    base = {
        s: region.runtime_overhead_mb + (2 + k) * SP[s] + SB[s] + 2 * sigma * (IN[s] + OUT[s]) for s in S
    }
    if problem.schedule == "1f1b":
        big_a = sum(saved_mb)
        left = {}
        for s in S:
            parts = []
            for t in S:
                if t >= s:
                    w = pulp.LpVariable(f"w_{s}_{t}", lowBound=0)
                    lp += w >= SA[s] - big_a * (1 - used[t])
                    parts.append(w)
            left[s] = pulp.lpSum(parts)
        lam = {s: pulp.LpVariable(f"lam_{s}", cat="Binary") for s in S}
    for s in S:
        for m in tiers:
            for r in replicas:
                off = big_mem * (1 - q[(s, m, r)])
                held = sigma * per_replica[r] * SA[s]
                if problem.schedule == "gpipe":
                    lp += base[s] + held <= m + off
                else:
                    lp += base[s] + held <= m + off + big_mem * lam[s]
                    lp += base[s] + sigma * left[s] <= m + off + big_mem * (1 - lam[s])

    # Pipeline: fill (every stage once) plus the steady state of the busiest replica.
    t_iter = pulp.LpVariable("t_iter", lowBound=0)
    t_sync = pulp.LpVariable("t_sync", lowBound=0)
    t_upd = pulp.LpVariable("t_upd", lowBound=0)
    fill = pulp.lpSum(phi[s] + beta[s] for s in S)
    if problem.schedule == "gpipe":
        steady_f = pulp.LpVariable("steady_f", lowBound=0)
        steady_b = pulp.LpVariable("steady_b", lowBound=0)
        for s in S:
            for r in replicas:
                extra = per_replica[r] - 1
                lp += steady_f >= extra * phi[s] - extra * big_f * (1 - v[(s, r)])
                lp += steady_b >= extra * beta[s] - extra * big_g * (1 - v[(s, r)])
        steady = steady_f + steady_b
    else:
        steady = pulp.LpVariable("steady", lowBound=0)
        for s in S:
            for r in replicas:
                extra = per_replica[r] - 1
                lp += steady >= extra * (phi[s] + beta[s]) - extra * (big_f + big_g) * (1 - v[(s, r)])
    for s in S:
        lp += t_sync >= sync[s]
        lp += t_upd >= upd[s]
    lp += t_iter >= fill + steady + t_sync + t_upd

    # Cost: GB-seconds of every function alive for the iteration (g = q * t), requests, storage.
    prices = region.prices  # in micro-dollars below
    g = {key: pulp.LpVariable(f"g_{key[0]}_{key[1]}_{key[2]}", lowBound=0) for key in q}
    for key, var in g.items():
        lp += var >= t_iter - big_t * (1 - q[key])
    compute_usd = 1e6 * prices.gb_second * pulp.lpSum(r * m / 1024 * g[(s, m, r)] for (s, m, r) in q)
    request_usd = prices.per_million_requests * pulp.lpSum(r * q[(s, m, r)] for (s, m, r) in q)
    puts = 2 * M * (stage_count - 1) + pulp.lpSum(r * r * q[(s, m, r)] for (s, m, r) in q if r > 1)
    gets = M + 2 * M * (stage_count - 1) + pulp.lpSum(2 * r * (r - 1) * q[(s, m, r)] for (s, m, r) in q if r > 1)
    storage_usd = 1e3 * (prices.storage_put_per_1000 * puts + prices.storage_get_per_1000 * gets)
    cost = compute_usd + request_usd + storage_usd

    lp += pulp.lpSum(r * q[(s, m, r)] for (s, m, r) in q) <= problem.function_limit
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
    if status not in ("Optimal",) and not _has_solution(lp):
        return None
    gap = _gap(lp, solver_name, status)
    stages = []
    for s in S:
        if (pulp.value(used[s]) or 0) < 0.5:
            continue
        members = [b for b in range(n_blocks) if (b, s) in z and (z[(b, s)].value() or 0) > 0.5]
        (m, r) = next((m, r) for m in tiers for r in replicas if (q[(s, m, r)].value() or 0) > 0.5)
        stages.append(StageChoice(min(members), max(members), m, r))
    plan = Plan(mu, tuple(stages))
    evaluation = model.evaluate(plan)
    primary = objective_key(problem, objective, evaluation)[0]
    return Solution(plan, evaluation, primary, "optimal" if gap <= 1e-6 else "feasible", gap, solve_s, solver_name)


def _has_solution(lp: pulp.LpProblem) -> bool:
    return lp.sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible)


def _gap(lp: pulp.LpProblem, solver_name: str, status: str) -> float:
    if solver_name == "HiGHS":
        try:
            info = lp.solverModel.getInfo()
            gap = float(info.mip_gap)
            return 0.0 if math.isinf(gap) or gap < 0 else gap
        except Exception:  # noqa: BLE001 - older highspy: fall back to the status
            pass
    return 0.0 if status == "Optimal" else float("inf")
