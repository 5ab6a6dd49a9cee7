"""The inter-region elastic schedule (Cloudless-Training): which regions train, each with which
pipeline configuration from its own frontier, how much of the data moves between regions first, and
where the global model lives; one MILP (pulp), checked against enumeration in the tests.

The training is `iterations` steps of `global_batch` samples in total, S = iterations x B samples.
Each region trains its own replica of the model on the data it holds after the moves, d_r, at its
own pace, and the regions' models meet every round (R rounds: every `sync_every` iterations of the
whole training). Every sample is seen equally often, so region r processes n_r = S d_r / N samples
(N the data in all regions), I_r = n_r / B iterations, I_r / R per round. Data moves in parts of
1/Q of a region's data, before training, over the WAN link (time) at the sender's egress price.

Synchronisation, per round, by the largest stage of a region's plan (stages sync in parallel):
- `model-average` (MA): each region writes its model to its own storage (its parameter server) and
  reads every other training region's, then takes the sample-weighted mean. A barrier: every region
  waits for the slowest, so functions stay alive for the whole training T.
- `asgd-ga` (ASGD with gradient accumulation): each region accumulates its updates over its round
  and adds them to the global model in the server region (read, add, write a new version), then
  trains on from that version. No region waits for another, so a region's functions are alive for
  its own work and sync only.

Time: T >= move-in time + I_r tau_r + R sync_r for every training region. Cost: function time at
the option's rate (USD per second alive) plus its per-iteration requests, egress for moves and
syncs, and sync requests. See docs/cost_model.md ("Between regions").
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Literal

import pulp

from cloudless.compiler.cost_model import Objective, Plan
from cloudless.ir.catalog import Link

SyncStrategy = Literal["asgd-ga", "model-average"]
SYNC_STRATEGIES: tuple[SyncStrategy, ...] = ("asgd-ga", "model-average")
#: data moves in parts of 1/PARTS of a region's data
PARTS = 16


def choose_solver(time_limit: float | None) -> tuple[pulp.LpSolver, str]:
    """HiGHS through pulp where installed, else the CBC that pulp bundles."""
    if pulp.HiGHS().available():
        return pulp.HiGHS(msg=False, timeLimit=time_limit, gapRel=1e-7, threads=1), "HiGHS"
    return pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit, gapRel=1e-7), "CBC"


@dataclass(frozen=True)
class RegionOption:
    """One point of a region's frontier: a pipeline plan and its per-iteration figures."""

    plan: Plan
    iteration_s: float
    compute_usd: float  # per iteration: GB-seconds of its functions while alive
    fixed_usd: float  # per iteration: function requests and storage operations
    largest_stage_bytes: int  # parameter bytes of its largest stage (what one sync moves per stage)
    stages: int

    @property
    def usd_per_second(self) -> float:
        """The rate of its functions' GB-seconds (what waiting at a barrier costs)."""
        return self.compute_usd / self.iteration_s if self.iteration_s > 0 else 0.0


@dataclass(frozen=True)
class RegionSite:
    name: str
    data: int  # training samples held here
    options: tuple[RegionOption, ...]
    egress_usd_per_gb: float
    put_usd: float  # one storage PUT
    get_usd: float
    local: Link  # a function to its own region's storage (the largest tier's bandwidth)


@dataclass(frozen=True)
class GeoProblem:
    sites: tuple[RegionSite, ...]
    links: dict[frozenset[str], Link]
    global_batch: int
    iterations: int
    sync: SyncStrategy
    sync_every: int
    sample_bytes: float
    parts: int = PARTS

    @property
    def rounds(self) -> int:
        return max(1, round(self.iterations / self.sync_every))

    @property
    def total_data(self) -> int:
        return sum(s.data for s in self.sites)

    @property
    def total_samples(self) -> int:
        return self.iterations * self.global_batch

    def link(self, a: str, b: str) -> Link:
        if a == b:
            return next(s.local for s in self.sites if s.name == a)
        return self.links[frozenset((a, b))]


@dataclass(frozen=True)
class GeoPlan:
    """options[i]: the option index region i trains with, or None; moves: ((from, to), parts)."""

    options: tuple[int | None, ...]
    moves: tuple[tuple[tuple[int, int], int], ...] = ()
    server: int | None = None  # ASGD-GA: the region holding the global model


@dataclass(frozen=True)
class RegionFigures:
    data: float  # samples held after the moves
    iterations: float
    move_in_s: float
    work_s: float
    sync_s: float  # all rounds
    alive_s: float
    compute_usd: float
    fixed_usd: float
    sync_usd: float
    move_usd: float  # egress of the data it sends


@dataclass(frozen=True)
class GeoEvaluation:
    training_s: float
    cost_usd: float
    regions: tuple[RegionFigures | None, ...]
    violations: tuple[str, ...] = field(default_factory=tuple)

    @property
    def feasible(self) -> bool:
        return not self.violations


def _sync_terms(problem: GeoProblem, r: int, option: RegionOption, others: list[int], server: int | None):
    """One round of region r's sync: (seconds, egress USD, requests USD), given the other training
    regions and (ASGD-GA) the server. Stages sync in parallel: the largest stage sets the time."""
    site = problem.sites[r]
    nbytes = option.largest_stage_bytes
    gb = option.largest_stage_bytes * option.stages / 1e9  # all stages' bytes for egress (upper bound)
    if problem.sync == "model-average":
        seconds = site.local.transfer_s(nbytes)  # write its own model
        egress = 0.0
        for b in others:
            seconds += problem.link(site.name, problem.sites[b].name).transfer_s(nbytes)
            egress += gb * problem.sites[b].egress_usd_per_gb  # b's model leaves b
        requests = option.stages * (site.put_usd + len(others) * site.get_usd)
        return seconds, egress, requests
    assert server is not None
    link = problem.link(site.name, problem.sites[server].name)
    seconds = 2 * link.transfer_s(nbytes)  # read the global version, write the next
    egress = 0.0 if server == r else gb * (site.egress_usd_per_gb + problem.sites[server].egress_usd_per_gb)
    serving = problem.sites[server]
    requests = option.stages * (serving.put_usd + serving.get_usd)
    return seconds, egress, requests


def evaluate(problem: GeoProblem, plan: GeoPlan) -> GeoEvaluation:
    """The closed form of a plan's training time and cost (what the MILP optimises, written apart)."""
    n = len(problem.sites)
    held = [float(s.data) for s in problem.sites]
    move_in = [0.0] * n
    move_usd = [0.0] * n
    violations: list[str] = []
    sent = [0] * n
    for (a, b), parts in plan.moves:
        if parts <= 0:
            continue
        sent[a] += parts
        part = problem.sites[a].data / problem.parts
        held[a] -= part * parts
        held[b] += part * parts
        link = problem.link(problem.sites[a].name, problem.sites[b].name)
        move_in[b] += parts * link.transfer_s(part * problem.sample_bytes)  # one request per part
        move_usd[a] += parts * part * problem.sample_bytes / 1e9 * problem.sites[a].egress_usd_per_gb
    for a in range(n):
        if sent[a] > problem.parts:
            violations.append(f"{problem.sites[a].name} sends {sent[a]} of its {problem.parts} parts")
    training = [i for i in range(n) if plan.options[i] is not None]
    for i in range(n):
        if held[i] > 1e-9 and plan.options[i] is None:
            violations.append(f"{problem.sites[i].name} holds data but does not train")
    if not training:
        violations.append("no region trains")
    if problem.sync == "asgd-ga" and len(training) > 1 and (plan.server is None or plan.server not in training):
        violations.append("ASGD-GA needs a server among the training regions")
    per_sample = problem.total_samples / problem.total_data
    rounds = problem.rounds
    figures: list[RegionFigures | None] = [None] * n
    ends = []
    for r in training:
        option = problem.sites[r].options[plan.options[r]]  # type: ignore[index]
        iterations = held[r] * per_sample / problem.global_batch
        others = [b for b in training if b != r]
        if len(training) > 1:
            seconds, egress, requests = _sync_terms(problem, r, option, others, plan.server)
        else:
            seconds = egress = requests = 0.0
        work = iterations * option.iteration_s
        ends.append(move_in[r] + work + rounds * seconds)
        figures[r] = RegionFigures(
            data=held[r],
            iterations=iterations,
            move_in_s=move_in[r],
            work_s=work,
            sync_s=rounds * seconds,
            alive_s=work + rounds * seconds,
            compute_usd=0.0,
            fixed_usd=iterations * option.fixed_usd,
            sync_usd=rounds * (egress + requests),
            move_usd=move_usd[r],
        )
    training_s = max(ends, default=0.0)
    total = sum(move_usd)
    final: list[RegionFigures | None] = []
    for r, fig in enumerate(figures):
        if fig is None:
            final.append(None)
            continue
        option = problem.sites[r].options[plan.options[r]]  # type: ignore[index]
        # A barrier keeps every region's functions alive until the slowest is done.
        alive = training_s if problem.sync == "model-average" and len(training) > 1 else fig.alive_s
        compute = option.usd_per_second * alive
        fig = RegionFigures(**{**fig.__dict__, "alive_s": alive, "compute_usd": compute})
        total += compute + fig.fixed_usd + fig.sync_usd
        final.append(fig)
    return GeoEvaluation(training_s, total, tuple(final), tuple(violations))


def objective_value(objective: Objective, evaluation: GeoEvaluation) -> tuple[float, float]:
    if objective in ("time", "time-under-budget"):
        return (evaluation.training_s, evaluation.cost_usd)
    return (evaluation.cost_usd, evaluation.training_s)


def within(evaluation: GeoEvaluation, deadline: float | None, budget: float | None) -> bool:
    if not evaluation.feasible:
        return False
    if deadline is not None and evaluation.training_s > deadline * (1 + 1e-9):
        return False
    return budget is None or evaluation.cost_usd <= budget * (1 + 1e-9)


@dataclass
class GeoSolution:
    plan: GeoPlan
    evaluation: GeoEvaluation
    status: str
    gap: float
    solve_s: float
    solver: str


class GeoInfeasible(Exception):
    pass


def solve_geo(
    problem: GeoProblem,
    objective: Objective = "cost",
    *,
    deadline: float | None = None,
    budget: float | None = None,
    time_limit: float | None = 30.0,
    allow_moves: bool = True,
    only: Iterable[int] | None = None,
) -> GeoSolution:
    """The best schedule: one MILP per candidate server region (ASGD-GA; one MILP for MA), the best
    of them. `allow_moves=False` keeps data where it is; `only` restricts the training regions
    (the baselines are these restrictions of the same program)."""
    started = time.perf_counter()
    allowed = set(range(len(problem.sites)) if only is None else only)
    servers: list[int | None] = sorted(allowed) if problem.sync == "asgd-ga" else [None]
    best: GeoSolution | None = None
    bound = math.inf
    proven = True
    solver_name = ""
    for server in servers:
        result = _solve_one(problem, objective, server, deadline, budget, time_limit, allow_moves, allowed)
        if result is None:
            continue
        plan, status, lower, solver_name = result
        bound = min(bound, lower)
        proven = proven and status in ("Optimal", "Infeasible")
        if plan is None:
            continue
        evaluation = evaluate(problem, plan)
        if not within(evaluation, deadline, budget):
            continue
        candidate = GeoSolution(plan, evaluation, "", 0.0, 0.0, solver_name)
        if best is None or objective_value(objective, evaluation) < objective_value(objective, best.evaluation):
            best = candidate
    if best is None:
        raise GeoInfeasible("no schedule of the regions meets the request")
    value = objective_value(objective, best.evaluation)[0]
    if bound == -math.inf:
        gap = math.inf  # a solve stopped by its time limit: no bound
    else:
        gap = 0.0 if not math.isfinite(bound) or value <= 0 else max(0.0, (value - bound) / value)
    best.gap = 0.0 if gap < 1e-6 else gap
    best.status = "optimal" if proven and best.gap == 0.0 else "feasible"
    best.solve_s = time.perf_counter() - started
    return best


def _solve_one(
    problem: GeoProblem,
    objective: Objective,
    server: int | None,
    deadline: float | None,
    budget: float | None,
    time_limit: float | None,
    allow_moves: bool,
    allowed: set[int],
) -> tuple[GeoPlan | None, str, float, str] | None:
    """The MILP for one server choice. Variables: y[r,k] (region r trains with option k), u[r,k]
    its iterations (0 unless y[r,k]), z[r] = sum_k y[r,k], move[a,b] (integer parts), and for the
    pairwise sync terms v[r,k,b] >= y[r,k] + z[b] - 1 (r with option k and b both train); for MA
    alive[r,k] >= T - T_max (1 - y[r,k]) (the barrier keeps r alive for all of T)."""
    sites = problem.sites
    n = len(sites)
    names = [s.name for s in sites]
    rounds = problem.rounds
    per_sample = problem.total_samples / problem.total_data
    B = problem.global_batch
    most_iterations = problem.total_samples / B
    lp = pulp.LpProblem("cloudless_regions", pulp.LpMinimize)
    y = {
        (r, k): pulp.LpVariable(f"y_{r}_{k}", cat="Binary")
        for r in range(n)
        if r in allowed
        for k in range(len(sites[r].options))
    }
    u = {key: pulp.LpVariable(f"u_{key[0]}_{key[1]}", lowBound=0) for key in y}
    z = {r: pulp.lpSum(y[r, k] for k in range(len(sites[r].options)) if (r, k) in y) for r in range(n)}
    moves = {}
    if allow_moves:
        for a in range(n):
            for b in allowed:
                if a != b and sites[a].data > 0:
                    moves[a, b] = pulp.LpVariable(f"m_{a}_{b}", lowBound=0, upBound=problem.parts, cat="Integer")
    T = pulp.LpVariable("T", lowBound=0)
    for r in range(n):
        lp += z[r] <= 1
        out_parts = pulp.lpSum(moves[a, b] for (a, b) in moves if a == r)
        lp += out_parts <= problem.parts
        part = sites[r].data / problem.parts
        held = (
            sites[r].data
            - part * out_parts
            + pulp.lpSum(sites[a].data / problem.parts * moves[a, b] for (a, b) in moves if b == r)
        )
        # Its iterations follow from the data it holds; a region holding data must train.
        lp += pulp.lpSum(u[r, k] for k in range(len(sites[r].options)) if (r, k) in y) == held * per_sample / B
    for (r, k), var in y.items():
        lp += u[r, k] <= most_iterations * var
    if server is not None:
        lp += z[server] == 1  # the server trains (it holds the global model next to its functions)
    # Pairwise sync terms: v[r,k,b] = y[r,k] * z[b].
    v = {}
    for r, k in y:
        for b in allowed:
            if b != r:
                v[r, k, b] = pulp.LpVariable(f"v_{r}_{k}_{b}", lowBound=0, upBound=1)
                lp += v[r, k, b] >= y[r, k] + z[b] - 1
    others_any = {(r, k): pulp.lpSum(v[r, k, b] for b in allowed if b != r) for (r, k) in y}

    def sync_parts(r: int, k: int) -> tuple[pulp.LpAffineExpression, pulp.LpAffineExpression]:
        """Region r's sync over all rounds with option k: (seconds, USD), linear in y and v.
        Zero when r trains alone: every term is carried by a v (another region also trains)."""
        option = sites[r].options[k]
        seconds: list = []
        usd: list = []
        if problem.sync == "model-average":
            # Its own write, once, when any other region trains: bounded by each v and by y.
            w = pulp.LpVariable(f"w_{r}_{k}", lowBound=0, upBound=1)
            lp.addConstraint(w <= y[r, k])
            lp.addConstraint(w <= others_any[r, k])
            for b in allowed:
                if b != r:
                    lp.addConstraint(w >= v[r, k, b])
            seconds.append(rounds * sites[r].local.transfer_s(option.largest_stage_bytes) * w)
            usd.append(rounds * option.stages * sites[r].put_usd * w)
            for b in allowed:
                if b == r:
                    continue
                link = problem.link(names[r], names[b])
                gb = option.largest_stage_bytes * option.stages / 1e9
                seconds.append(rounds * link.transfer_s(option.largest_stage_bytes) * v[r, k, b])
                usd.append(rounds * (gb * sites[b].egress_usd_per_gb + option.stages * sites[r].get_usd) * v[r, k, b])
        else:
            assert server is not None
            # Syncs happen when another region trains; with the server training, that is "r is not
            # alone": r != server -> v[r,k,server]; r == server -> any v.
            active = v[r, k, server] if r != server else pulp.LpVariable(f"w_{r}_{k}", lowBound=0, upBound=1)
            if r == server:
                lp.addConstraint(active <= y[r, k])
                lp.addConstraint(active <= others_any[r, k])
                for b in allowed:
                    if b != r:
                        lp.addConstraint(active >= v[r, k, b])
            link = problem.link(names[r], names[server])
            gb = option.largest_stage_bytes * option.stages / 1e9
            egress = 0.0 if r == server else gb * (sites[r].egress_usd_per_gb + sites[server].egress_usd_per_gb)
            requests = option.stages * (sites[server].put_usd + sites[server].get_usd)
            seconds.append(rounds * 2 * link.transfer_s(option.largest_stage_bytes) * active)
            usd.append(rounds * (egress + requests) * active)
        return pulp.lpSum(seconds), pulp.lpSum(usd)

    move_in = {
        r: pulp.lpSum(
            problem.link(names[a], names[b]).transfer_s(sites[a].data / problem.parts * problem.sample_bytes) * var
            for (a, b), var in moves.items()
            if b == r
        )
        for r in range(n)
    }
    sync_of = {(r, k): sync_parts(r, k) for (r, k) in y}
    for r in range(n):
        work = pulp.lpSum(
            sites[r].options[k].iteration_s * u[r, k] for k in range(len(sites[r].options)) if (r, k) in y
        )
        syncs = pulp.lpSum(sync_of[r, k][0] for k in range(len(sites[r].options)) if (r, k) in y)
        lp += T >= move_in[r] + work + syncs
    cost_terms = []
    for (a, _), var in moves.items():
        part = sites[a].data / problem.parts
        cost_terms.append(part * problem.sample_bytes / 1e9 * sites[a].egress_usd_per_gb * var)
    # An upper bound of T (for the barrier's big-M rows): every part moved, the slowest option doing
    # all the iterations, every sync term at once.
    t_max = (
        max((most_iterations * sites[r].options[k].iteration_s for (r, k) in y), default=0.0)
        + sum(problem.parts * sum(abs(c) for c in move_in[r].values()) for r in range(n))
        + sum(sum(abs(c) for c in seconds.values()) for seconds, _ in sync_of.values())
    )
    for r, k in y:
        option = sites[r].options[k]
        cost_terms.append(option.fixed_usd * u[r, k])
        cost_terms.append(sync_of[r, k][1])
        if problem.sync == "model-average":
            # Alive for T when another region trains (the barrier), else for its own work.
            alive = pulp.LpVariable(f"alive_{r}_{k}", lowBound=0)
            lp += alive >= option.iteration_s * u[r, k] + sync_of[r, k][0]
            for b in allowed:
                if b != r:
                    lp += alive >= T - t_max * (1 - v[r, k, b])
            cost_terms.append(option.usd_per_second * alive)
        else:
            cost_terms.append(option.compute_usd * u[r, k] + option.usd_per_second * sync_of[r, k][0])
    cost = pulp.lpSum(cost_terms)
    if deadline is not None:
        lp += T <= deadline
    if budget is not None:
        lp += cost <= budget
    lp += T if objective in ("time", "time-under-budget") else cost
    solver, solver_name = choose_solver(time_limit)
    lp.solve(solver)
    status = pulp.LpStatus[lp.status]
    if status == "Infeasible" or lp.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        return (None, status, math.inf if status == "Infeasible" else -math.inf, solver_name)
    options = tuple(
        next((k for k in range(len(sites[r].options)) if (r, k) in y and (y[r, k].value() or 0) > 0.5), None)
        for r in range(n)
    )
    chosen_moves = tuple(
        sorted(((a, b), round(var.value() or 0)) for (a, b), var in moves.items() if round(var.value() or 0) > 0)
    )
    # A time limit leaves pulp's status "Optimal" with an integer-feasible solution: no proof, no bound.
    if lp.sol_status != pulp.LpSolutionOptimal:
        return GeoPlan(options, chosen_moves, server), "Not Solved", -math.inf, solver_name
    return GeoPlan(options, chosen_moves, server), status, float(pulp.value(lp.objective)), solver_name


def enumerate_plans(problem: GeoProblem) -> Iterator[GeoPlan]:
    """Every plan of a small problem (the tests' ground truth)."""
    n = len(problem.sites)
    choices = [[None, *range(len(s.options))] for s in problem.sites]
    pairs = [(a, b) for a in range(n) for b in range(n) if a != b and problem.sites[a].data > 0]
    servers: list[int | None] = list(range(n)) if problem.sync == "asgd-ga" else [None]
    for options in itertools.product(*choices):
        for counts in itertools.product(range(problem.parts + 1), repeat=len(pairs)):
            moves = tuple((pair, c) for pair, c in zip(pairs, counts, strict=True) if c)
            for server in servers:
                yield GeoPlan(tuple(options), moves, server)


@dataclass(frozen=True)
class RegionShare:
    """What a training region of a schedule does, in whole numbers for the workflow."""

    site: int
    samples: int  # held after the moves
    sources: tuple[tuple[str, int, int], ...]  # (region, first, count) of that region's training data
    iterations: int
    round_iterations: int
    weight: float  # its share of a round's samples


def region_shares(problem: GeoProblem, plan: GeoPlan) -> list[RegionShare]:
    """The schedule's data slices and iterations. A region keeps the head of its data and sends
    consecutive parts of its tail to the receivers in region order; each region runs R rounds of
    round(I_r / R) iterations (at least one), I_r from the samples it holds."""
    sites = problem.sites
    kept: dict[int, tuple[int, int]] = {}
    incoming: dict[int, list[tuple[str, int, int]]] = {r: [] for r in range(len(sites))}
    for a, site in enumerate(sites):
        sends = sorted((b, parts) for (src, b), parts in plan.moves if src == a and parts > 0)
        at = problem.parts - sum(parts for _, parts in sends)

        def boundary(part: int, data: int = site.data) -> int:
            return round(data * part / problem.parts)

        kept[a] = (0, boundary(at))
        for b, parts in sends:
            first, last = boundary(at), boundary(at + parts)
            if last > first:
                incoming[b].append((site.name, first, last - first))
            at += parts
    per_sample = problem.total_samples / problem.total_data
    shares = []
    for r, option in enumerate(plan.options):
        if option is None:
            continue
        sources = ([(sites[r].name, 0, kept[r][1])] if kept[r][1] > 0 else []) + sorted(incoming[r])
        samples = sum(count for _, _, count in sources)
        if samples == 0:
            continue  # nothing to train on (never better than not training: it only adds syncs)
        rounds = problem.rounds
        per_round = max(1, round(samples * per_sample / problem.global_batch / rounds))
        shares.append(RegionShare(r, samples, tuple(sources), per_round * rounds, per_round, 0.0))
    total = sum(s.round_iterations for s in shares)
    return [RegionShare(**{**s.__dict__, "weight": round(s.round_iterations / total, 9)}) for s in shares]
