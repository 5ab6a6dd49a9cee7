"""The inter-region elastic schedule (Cloudless-Training): which regions train, each with which
pipeline configuration from its own frontier, how much of the data moves between regions first, and
where the global model lives; one MILP (solver.py, as the pipeline's), checked against enumeration
in the tests.

The training is `iterations` steps of `global_batch` samples in total, S = iterations x B samples.
Each region trains its own replica of the model on the data it holds after the moves, d_r, at its
own pace, and the regions' models meet every round (R rounds: every `sync_every` iterations of the
whole training). Every sample is seen equally often, so region r processes n_r = S d_r / N samples
(N the data in all regions), I_r = n_r / B iterations, I_r / R per round. Data moves in parts of
1/Q of a region's data, before training, over the WAN link (time) at the sender's egress price.

Under `sync` (synchronous cross-region SGD) every region runs all the iterations, each on its
share of every global batch (d_r / N of it), and the gradients meet across regions every iteration:
R = iterations rounds. Its work is the same n_r / B iteration-equivalents at tau_r (compute scales
with the share of the batch), and a barrier every iteration: T = the latest move-in + the slowest
region's work and syncs.

Synchronisation, per round, by the largest stage of a region's plan (stages sync in parallel):
- `sync`: as model averaging, with gradients instead of models: each region writes its stage's
  gradient to its own storage and reads every other training region's (both ways over each link),
  every iteration.
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

The catalog's constraints: data residency (a region's data moves only to the regions its
`data_may_move_to` names; none: it stays), capacity (an option's concurrent functions within the
region's `limits.max_functions`, their memory within `limits.max_total_memory_mb`); data moves one
way per pair of regions; a training region runs at least one iteration per round (rounds <= its
iterations, so `ir.workflow.round_ends` holds).
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Literal

from ...ir.catalog import Link
from ...ir.workflow import whole_iterations
from .cost_model import MAX_ITERATION_S, MAX_ITERATION_USD, Objective, OutOfRange, Plan
from .solver import Goal, Program, SolveStatus, solve_program

SyncStrategy = Literal["sync", "asgd-ga", "model-average"]
SYNC_STRATEGIES: tuple[SyncStrategy, ...] = ("sync", "asgd-ga", "model-average")
#: the strategies with a barrier (every region waits for the slowest each round)
BARRIER: frozenset[str] = frozenset({"sync", "model-average"})
#: data moves in parts of 1/PARTS of a region's data
PARTS = 16


@dataclass(frozen=True)
class RegionOption:
    """One point of a region's frontier: a pipeline plan and its per-iteration figures."""

    plan: Plan
    iteration_s: float
    compute_usd: float  # per iteration: GB-seconds of its functions while alive
    fixed_usd: float  # per iteration: function requests and storage operations
    largest_stage_bytes: int  # parameter bytes of its largest stage (what one sync moves per stage)
    stages: int
    functions: int = 0  # concurrent functions (every stage's replicas)
    memory_mb: int = 0  # their memory together

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
    #: data residency: the regions its data may move to (None: any; empty: it stays here)
    may_move_to: frozenset[str] | None = None
    #: capacity: concurrent functions and their total memory (None: no limit beyond the options')
    max_functions: int | None = None
    max_memory_mb: int | None = None

    def may_send_to(self, other: str) -> bool:
        return self.may_move_to is None or other in self.may_move_to

    def fits(self, option: RegionOption) -> bool:
        """Whether an option is within the region's capacity."""
        if self.max_functions is not None and option.functions > self.max_functions:
            return False
        return self.max_memory_mb is None or option.memory_mb <= self.max_memory_mb


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
        """Inter-region syncs over the training: every iteration under `sync`."""
        if self.sync == "sync":
            return self.iterations
        return max(1, round(self.iterations / self.sync_every))

    def may_move(self, a: int, b: int) -> bool:
        """Whether region a's data may move to region b (data residency)."""
        return a != b and self.sites[a].data > 0 and self.sites[a].may_send_to(self.sites[b].name)

    def least_iterations(self) -> float:
        """What a training region runs at least (in iterations of the whole batch): one per round, or
        under `sync` one sample of every iteration."""
        if self.sync == "sync":
            return self.iterations / self.global_batch
        return float(self.rounds)

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

    def __post_init__(self) -> None:
        """Raise OutOfRange when a WAN link or an egress price of the catalog puts one transfer (a part of a
        region's data, or a stage's model) beyond MAX_ITERATION_S or MAX_ITERATION_USD: the schedule's MILP
        cannot weigh such figures against the others (it would find no schedule at all)."""
        largest = max((o.largest_stage_bytes for s in self.sites for o in s.options), default=0)
        part = max((s.data for s in self.sites), default=0) / self.parts * self.sample_bytes
        nbytes = max(largest, part)
        for i, a in enumerate(self.sites):
            for b in self.sites[i + 1 :]:
                link = self.link(a.name, b.name)
                seconds = link.transfer_s(nbytes)
                if not seconds <= MAX_ITERATION_S:
                    raise OutOfRange(
                        f"catalog wan link {a.name} <-> {b.name}: one transfer of {nbytes / 1e6:.3g} MB would take "
                        f"{seconds:.3g} s ({link.bandwidth_bps / 1e6:.3g} MB/s, {link.latency_s:.3g} s latency); "
                        f"beyond {MAX_ITERATION_S:.0e} s is no schedule: check the catalog's wan section"
                    )
        for site in self.sites:
            usd = site.egress_usd_per_gb * nbytes / 1e9
            if not usd <= MAX_ITERATION_USD:
                raise OutOfRange(
                    f"catalog region {site.name}: sending {nbytes / 1e6:.3g} MB to another region would cost "
                    f"{usd:.3g} USD; beyond {MAX_ITERATION_USD:.0e} USD is no schedule: check its prices.egress_per_gb"
                )


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


@dataclass(frozen=True)
class SyncTerm:
    """Part of one round's sync of a region: seconds on its clock, egress and request USD."""

    seconds: float
    egress_usd: float
    requests_usd: float

    @property
    def usd(self) -> float:
        return self.egress_usd + self.requests_usd


@dataclass(frozen=True)
class SyncCoefficients:
    """One round's sync of region r with one option, when at least one other region trains: `once`,
    plus `each[b]` for every other training region b. The closed form sums them over the regions
    that train (`per_round`); the MILP puts `once` on "another region trains" and `each[b]` on
    "b trains", so both charge the same terms."""

    once: SyncTerm
    each: dict[int, SyncTerm]

    def per_round(self, others: list[int]) -> tuple[float, float, float]:
        """(seconds, egress USD, requests USD) of one round with these other training regions."""
        if not others:
            return 0.0, 0.0, 0.0
        seconds, egress, requests = self.once.seconds, self.once.egress_usd, self.once.requests_usd
        for b in others:
            term = self.each.get(b)
            if term is not None:
                seconds += term.seconds
                egress += term.egress_usd
                requests += term.requests_usd
        return seconds, egress, requests


def sync_coefficients(problem: GeoProblem, r: int, option: RegionOption, server: int | None) -> SyncCoefficients:
    """Region r's sync per round with `option` and (ASGD-GA) the server. Stages sync in parallel:
    the largest stage sets the time; every stage's bytes pay egress (an upper bound)."""
    site = problem.sites[r]
    nbytes = option.largest_stage_bytes
    gb = option.largest_stage_bytes * option.stages / 1e9
    if problem.sync in BARRIER:
        # Write its own model (or gradient, under sync; a PUT per stage), then read each other region's
        # (egress leaves b).
        once = SyncTerm(site.local.transfer_s(nbytes), 0.0, option.stages * site.put_usd)
        each = {
            b: SyncTerm(
                problem.link(site.name, other.name).transfer_s(nbytes),
                gb * other.egress_usd_per_gb,
                option.stages * site.get_usd,
            )
            for b, other in enumerate(problem.sites)
            if b != r
        }
        return SyncCoefficients(once, each)
    assert server is not None
    serving = problem.sites[server]
    link = problem.link(site.name, serving.name)
    # Read the global version and write the next, at the server; egress both ways unless r serves.
    egress = 0.0 if server == r else gb * (site.egress_usd_per_gb + serving.egress_usd_per_gb)
    once = SyncTerm(2 * link.transfer_s(nbytes), egress, option.stages * (serving.put_usd + serving.get_usd))
    return SyncCoefficients(once, {})


def evaluate(problem: GeoProblem, plan: GeoPlan) -> GeoEvaluation:
    """The closed form of a plan's training time and cost (what the MILP optimises, written apart)."""
    n = len(problem.sites)
    held = [float(s.data) for s in problem.sites]
    move_in = [0.0] * n
    move_usd = [0.0] * n
    violations: list[str] = []
    sent = [0] * n
    pairs = set()
    for (a, b), parts in plan.moves:
        if parts <= 0:
            continue
        if not problem.may_move(a, b):
            violations.append(f"{problem.sites[a].name}'s data may not move to {problem.sites[b].name}")
        pairs.add((a, b))
        sent[a] += parts
        part = problem.sites[a].data / problem.parts
        held[a] -= part * parts
        held[b] += part * parts
        link = problem.link(problem.sites[a].name, problem.sites[b].name)
        move_in[b] += parts * link.transfer_s(part * problem.sample_bytes)  # one request per part
        move_usd[a] += parts * part * problem.sample_bytes / 1e9 * problem.sites[a].egress_usd_per_gb
    for a, b in pairs:
        if a < b and (b, a) in pairs:
            violations.append(f"data moves both ways between {problem.sites[a].name} and {problem.sites[b].name}")
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
    barrier = problem.sync in BARRIER and len(training) > 1
    figures: list[RegionFigures | None] = [None] * n
    ends = []
    for r in training:
        site = problem.sites[r]
        option = site.options[plan.options[r]]  # type: ignore[index]
        if not site.fits(option):
            violations.append(f"{site.name}: the option exceeds the region's capacity")
        iterations = held[r] * per_sample / problem.global_batch
        if len(training) > 1 and iterations < problem.least_iterations() * (1 - 1e-9):
            violations.append(f"{site.name} trains {iterations:.3g} iterations, fewer than its rounds")
        others = [b for b in training if b != r]
        if others:
            seconds, egress, requests = sync_coefficients(problem, r, option, plan.server).per_round(others)
        else:
            seconds = egress = requests = 0.0
        work = iterations * option.iteration_s
        ends.append((move_in[r], work + rounds * seconds))
        figures[r] = RegionFigures(
            data=held[r],
            iterations=float(problem.iterations) if problem.sync == "sync" else iterations,
            move_in_s=move_in[r],
            work_s=work,
            sync_s=rounds * seconds,
            alive_s=work + rounds * seconds,
            compute_usd=0.0,
            fixed_usd=iterations * option.fixed_usd,
            sync_usd=rounds * (egress + requests),
            move_usd=move_usd[r],
        )
    if problem.sync == "sync" and ends:
        # A barrier every iteration: all start once the last data is in, the slowest sets the pace.
        training_s = max(m for m, _ in ends) + max(w for _, w in ends)
    else:
        training_s = max((m + w for m, w in ends), default=0.0)
    total = sum(move_usd)
    final: list[RegionFigures | None] = []
    for r, fig in enumerate(figures):
        if fig is None:
            final.append(None)
            continue
        option = problem.sites[r].options[plan.options[r]]  # type: ignore[index]
        # A barrier keeps every region's functions alive until the slowest is done.
        alive = training_s if barrier else fig.alive_s
        compute = option.usd_per_second * alive
        fig = RegionFigures(**{**fig.__dict__, "alive_s": alive, "compute_usd": compute})
        total += compute + fig.fixed_usd + fig.sync_usd
        final.append(fig)
    return GeoEvaluation(training_s, total, tuple(final), tuple(violations))


def objective_value(objective: Objective, evaluation: GeoEvaluation) -> tuple[float, float]:
    """What is minimised: (primary, tie-break), for the whole training."""
    return Goal(objective).key(evaluation.training_s, evaluation.cost_usd)


def within(evaluation: GeoEvaluation, deadline: float | None, budget: float | None) -> bool:
    """A feasible schedule whose training meets the deadline and the budget."""
    return evaluation.feasible and Goal("cost", deadline, budget).within(evaluation.training_s, evaluation.cost_usd)


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
    equal_split: bool = False,
) -> GeoSolution:
    """The best schedule: one MILP per candidate server region (ASGD-GA; one MILP otherwise), the best
    of them. `allow_moves=False` keeps data where it is; `only` restricts the training regions;
    `equal_split` makes every allowed region train about the same share (within one part of data)
    (the baselines are these restrictions of the same program)."""
    started = time.perf_counter()
    allowed = set(range(len(problem.sites)) if only is None else only)
    servers: list[int | None] = [*sorted(allowed)] if problem.sync == "asgd-ga" else [None]
    best: GeoSolution | None = None
    bound = math.inf
    proven = True
    solver_name = ""
    for server in servers:
        plan, status, lower, solver_name = _solve_one(
            problem, Goal(objective, deadline, budget), server, time_limit, allow_moves, allowed, equal_split
        )
        bound = min(bound, lower)
        proven = proven and status in ("optimal", "infeasible")
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


#: a linear expression: column -> coefficient
Linear = dict[int, float]


def _add(expression: Linear, terms: Iterable[tuple[int, float]]) -> Linear:
    """Add terms to an expression in place (coefficients of the same column sum)."""
    for column, value in terms:
        expression[column] = expression.get(column, 0.0) + value
    return expression


def _solve_one(
    problem: GeoProblem,
    goal: Goal,
    server: int | None,
    time_limit: float | None,
    allow_moves: bool,
    allowed: set[int],
    equal_split: bool = False,
) -> tuple[GeoPlan | None, SolveStatus, float, str]:
    """The MILP for one server choice: (plan, status, lower bound, solver). Variables: y[r,k] (region
    r trains with option k), u[r,k] its iterations (0 unless y[r,k]), z[r] = sum_k y[r,k],
    move[a,b] (integer parts), and for the pairwise sync terms v[r,k,b] >= y[r,k] + z[b] - 1 (r with
    option k and b both train); for MA and sync alive[r,k] >= T - T_max (1 - v[r,k,b]) (the barrier
    keeps r alive for all of T); one[a,b] (a < b) says which way data may move between a and b. Only
    the options within a region's capacity, and the moves its data residency allows, are columns.
    A time-limited solve gives no bound (-inf)."""
    sites = problem.sites
    n = len(sites)
    names = [s.name for s in sites]
    rounds = problem.rounds
    per_sample = problem.total_samples / problem.total_data
    B = problem.global_batch
    most_iterations = problem.total_samples / B
    program = Program()
    y = {
        (r, k): program.column(0.0, 1.0, integer=True)
        for r in range(n)
        if r in allowed
        for k in range(len(sites[r].options))
        if sites[r].fits(sites[r].options[k])
    }
    u = {key: program.column() for key in y}
    z: dict[int, list[tuple[int, float]]] = {
        r: [(y[r, k], 1.0) for k in range(len(sites[r].options)) if (r, k) in y] for r in range(n)
    }
    moves: dict[tuple[int, int], int] = {}
    if allow_moves:
        for a in range(n):
            for b in sorted(allowed):
                if problem.may_move(a, b):
                    moves[a, b] = program.column(0.0, problem.parts, integer=True)
    for (a, b), forth in moves.items():
        if a < b and (b, a) in moves:
            # Data moves one way between two regions: forth only if one[a,b], back only if not.
            one = program.column(0.0, 1.0, integer=True)
            program.row([(forth, 1.0), (one, -float(problem.parts))], upper=0.0)
            program.row([(moves[b, a], 1.0), (one, float(problem.parts))], upper=float(problem.parts))
    T = program.column()
    for r in range(n):
        if z[r]:
            program.row(z[r], upper=1.0)
        out_parts = [(var, 1.0) for (a, _), var in moves.items() if a == r]
        if out_parts:
            program.row(out_parts, upper=problem.parts)
        part = sites[r].data / problem.parts
        # Its iterations follow from the data it holds; a region holding data must train.
        held = [(u[r, k], 1.0) for k in range(len(sites[r].options)) if (r, k) in y]
        held += [(var, part * per_sample / B) for (a, _), var in moves.items() if a == r]
        held += [(var, -(sites[a].data / problem.parts) * per_sample / B) for (a, b), var in moves.items() if b == r]
        rhs = sites[r].data * per_sample / B
        program.row(held, rhs, rhs)
    least = problem.least_iterations()
    for (r, k), var in y.items():
        program.row([(u[r, k], 1.0), (var, -most_iterations)], upper=0.0)
        program.row([(u[r, k], 1.0), (var, -least)], lower=0.0)  # at least one iteration per round
    if equal_split:
        # Every allowed region trains about 1/n of the samples (within one part of the largest holder's).
        share = most_iterations / len(allowed)
        slack = max(s.data for s in sites) / problem.parts * per_sample / B
        for r in allowed:
            program.row(z[r], 1.0, 1.0)
            mine = [(u[r, k], 1.0) for k in range(len(sites[r].options)) if (r, k) in y]
            program.row(mine, share - slack, share + slack)
    if server is not None:
        program.row(z[server], 1.0, 1.0)  # the server trains (it holds the global model next to its functions)
    # Pairwise sync terms: v[r,k,b] = y[r,k] * z[b].
    v: dict[tuple[int, int, int], int] = {}
    for r, k in y:
        for b in allowed:
            if b != r:
                v[r, k, b] = program.column(0.0, 1.0)
                program.row([(v[r, k, b], 1.0), (y[r, k], -1.0), *((c, -1.0) for c, _ in z[b])], lower=-1.0)

    def any_other(r: int, k: int) -> int:
        """A column equal to "r trains with k and another region trains": at most y and the sum of
        the v, at least each v."""
        w = program.column(0.0, 1.0)
        others = [v[r, k, b] for b in allowed if b != r]
        program.row([(w, 1.0), (y[r, k], -1.0)], upper=0.0)
        program.row([(w, 1.0), *((c, -1.0) for c in others)], upper=0.0)
        for c in others:
            program.row([(w, 1.0), (c, -1.0)], lower=0.0)
        return w

    def sync_parts(r: int, k: int) -> tuple[Linear, Linear]:
        """Region r's sync over all rounds with option k: (seconds, USD), linear in y and v, from the
        same coefficients as the closed form. Zero when r trains alone: every term is carried by a
        v (another region also trains)."""
        terms = sync_coefficients(problem, r, sites[r].options[k], server)
        # The terms paid once a round: with the server training, "not alone" is v[r,k,server] for
        # r != server (ASGD-GA); otherwise a column for "any other region trains".
        once = v[r, k, server] if server is not None and r != server else any_other(r, k)
        seconds: Linear = {once: rounds * terms.once.seconds}
        usd: Linear = {once: rounds * terms.once.usd}
        for b in allowed:
            if b != r and b in terms.each:
                _add(seconds, [(v[r, k, b], rounds * terms.each[b].seconds)])
                _add(usd, [(v[r, k, b], rounds * terms.each[b].usd)])
        return seconds, usd

    move_in: dict[int, Linear] = {
        r: {
            var: problem.link(names[a], names[b]).transfer_s(sites[a].data / problem.parts * problem.sample_bytes)
            for (a, b), var in moves.items()
            if b == r
        }
        for r in range(n)
    }
    sync_of = {(r, k): sync_parts(r, k) for (r, k) in y}
    for r in range(n):
        # T >= move-in + work + syncs of every region; under sync (a barrier every iteration) T >= the
        # move-in of every region a + the work and syncs of every region r.
        for a in range(n) if problem.sync == "sync" else [r]:
            ends: Linear = {T: 1.0}
            _add(ends, ((var, -c) for var, c in move_in[a].items()))
            _add(
                ends,
                ((u[r, k], -sites[r].options[k].iteration_s) for k in range(len(sites[r].options)) if (r, k) in y),
            )
            for k in range(len(sites[r].options)):
                if (r, k) in y:
                    _add(ends, ((var, -c) for var, c in sync_of[r, k][0].items()))
            program.row(list(ends.items()), lower=0.0)
    cost: Linear = {}
    for (a, _), var in moves.items():
        part = sites[a].data / problem.parts
        _add(cost, [(var, part * problem.sample_bytes / 1e9 * sites[a].egress_usd_per_gb)])
    # An upper bound of T (for the barrier's big-M rows): every part moved, the slowest option doing
    # all the iterations, every sync term at once.
    t_max = (
        max((most_iterations * sites[r].options[k].iteration_s for (r, k) in y), default=0.0)
        + sum(problem.parts * sum(abs(c) for c in move_in[r].values()) for r in range(n))
        + sum(sum(abs(c) for c in seconds.values()) for seconds, _ in sync_of.values())
    )
    for r, k in y:
        option = sites[r].options[k]
        seconds, usd = sync_of[r, k]
        _add(cost, [(u[r, k], option.fixed_usd)])
        _add(cost, usd.items())
        if problem.sync in BARRIER:
            # Alive for T when another region trains (the barrier), else for its own work.
            alive = program.column()
            program.row(
                [(alive, 1.0), (u[r, k], -option.iteration_s), *((c, -x) for c, x in seconds.items())], lower=0.0
            )
            for b in allowed:
                if b != r:
                    program.row([(alive, 1.0), (T, -1.0), (v[r, k, b], -t_max)], lower=-t_max)
            _add(cost, [(alive, option.usd_per_second)])
        else:
            _add(cost, [(u[r, k], option.compute_usd)])
            _add(cost, ((c, option.usd_per_second * x) for c, x in seconds.items()))
    goal.constrain(program, T, list(cost.items()))
    outcome = solve_program(program, time_limit)
    if outcome.values is None:
        return None, outcome.status, math.inf if outcome.status == "infeasible" else -math.inf, outcome.solver
    values = outcome.values
    options = tuple(
        next((k for k in range(len(sites[r].options)) if (r, k) in y and values[y[r, k]] > 0.5), None) for r in range(n)
    )
    chosen_moves = tuple(
        sorted(((a, b), round(values[var])) for (a, b), var in moves.items() if round(values[var]) > 0)
    )
    plan = GeoPlan(options, chosen_moves, server)
    if outcome.status != "optimal":
        return plan, outcome.status, -math.inf, outcome.solver  # stopped by the time limit: no proof
    return plan, outcome.status, outcome.bound, outcome.solver


def enumerate_plans(problem: GeoProblem) -> Iterator[GeoPlan]:
    """Every plan of a small problem (the tests' ground truth)."""
    n = len(problem.sites)
    choices = [[None, *range(len(s.options))] for s in problem.sites]
    pairs = [(a, b) for a in range(n) for b in range(n) if problem.may_move(a, b)]
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
    weight: float  # its share of the samples (model averaging's weight; under sync its share of a batch)


def region_shares(problem: GeoProblem, plan: GeoPlan) -> list[RegionShare]:
    """The schedule's data slices and iterations. A region keeps the head of its data and sends
    consecutive parts of its tail to the receivers in region order. Under `sync` every region runs
    all the iterations; otherwise the iterations I_r (from the samples it holds) are rounded so that
    they add up to the training's exactly (largest remainders), each at least the rounds."""
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
    held: list[tuple[int, int, tuple[tuple[str, int, int], ...]]] = []
    for r, option in enumerate(plan.options):
        if option is None:
            continue
        sources = ([(sites[r].name, 0, kept[r][1])] if kept[r][1] > 0 else []) + sorted(incoming[r])
        samples = sum(count for _, _, count in sources)
        if samples == 0:
            raise ValueError(f"{sites[r].name} trains but holds no data after the moves")
        held.append((r, samples, tuple(sources)))
    total_samples = sum(samples for _, samples, _ in held)
    if problem.sync == "sync" or len(held) == 1:
        counts = [problem.iterations] * len(held)
    else:
        counts = whole_iterations(
            [problem.iterations * samples / total_samples for _, samples, _ in held], problem.iterations, problem.rounds
        )
    return [
        RegionShare(r, samples, sources, count, round(samples / total_samples, 9))
        for (r, samples, sources), count in zip(held, counts, strict=True)
    ]
