"""Why the chosen plan won: the best plan of each family of plans it is not in, and the term it loses by.

`explain(result, options)` compares the chosen plan with the best plan, by the request's objective and
within its limits, of each family the chosen plan is not in:

- its structure: a pipeline (2 or more stages) when the plan is one stage; data parallelism (1 stage)
  when it pipelines over 2, fewer stages when over more;
- its replicas: every stage under the plan's largest count, or every stage over its smallest;
- its memory: every stage on a tier under the plan's largest, or over its smallest;
- another micro-batch size.

A family's best plan is the planner's own answer over a restricted problem (`planner.solve` over some
block ranges, replica counts, tiers or micro-batch sizes), or the data-parallel baseline, which is by
enumeration the best plan of one stage; every figure is `CostModel.evaluate`'s. A family whose
candidates the request leaves out (--replicas, the catalog's tiers, TRAINING's micro-batch sizes) or
whose every plan breaks a limit says so instead.

Each plan's iteration time is split into terms that add up to `Evaluation.iteration_s`, following the
evaluation's fill + steady + overhang (docs/cost_model.md): every stage's compute, data download and
transfers in the fill; the steady term's micro-batches on the lane (compute, download or upload) that
bounds them; and the overhang, the end of the last-finishing stage's tail, its optimizer update and
then its gradient sync. Its cost splits into keeping its functions alive through each of those, its
invocations and its storage requests. The term whose difference is the largest is why the alternative
lost; the sentence also sums the other terms it loses by and names what it saves.

The family solves run at most EXPLAIN_TIME_LIMIT_S per micro-batch size: on a large model a family's
best may then be the best found, not proven (`Alternative.proven`, and the sentence says so).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ...codegen.numbers import fmt
from ...ir.catalog import Region
from ...ir.plan import Alternative as AlternativeDocument
from ...ir.plan import AlternativeFamily, AlternativeStage, PlanTerm, TrainingPlan
from .cost_model import CostModel, Evaluation, Objective, Plan, Problem
from .explain_text import (
    TIE,
    TIME_TERMS,
    Unit,
    amount,
    as_factor,
    describe_plan,
    function_gb,
    listed,
    loss_text,
    pair,
    ratio,
    ties,
)
from .pipeline_milp import solve
from .pipeline_program import Infeasible, Solution
from .plan import PlanOptions, PlanResult
from .solver import Goal

#: a family's solve may take at most this long per micro-batch size (and no longer than the plan's own)
EXPLAIN_TIME_LIMIT_S = 2.0
#: a family's best found within this relative gap of the family's optimum counts as its best: closer than the
#: figures the sentences print (the planner calls a plan optimal within 1e-6, and may end a quick solve a few
#: 1e-6 away)
PROVEN_GAP = 1e-4
#: a term's difference below this share of the plans' figure is not named as a reason
NEGLIGIBLE = 1e-6


@dataclass(frozen=True)
class Alternative:
    """The best plan of a family the chosen plan is not in, and why it lost; `plan` is None when the
    family has no plan (then `summary` says why)."""

    family: AlternativeFamily
    label: str
    description: str
    plan: Plan | None
    evaluation: Evaluation | None
    #: whether `plan` is the family's best, proven within PROVEN_GAP (False: the best the solver found)
    proven: bool
    #: what `terms` measure per iteration: the objective's (the other measure when the two plans tie on it)
    unit: Unit
    #: term -> (the alternative's, the chosen plan's), in TIME_TERMS or COST_TERMS order
    terms: dict[str, tuple[float, float]]
    #: the term the alternative loses most by, and the one it gains most by ("": none)
    loses_by: str
    gains_by: str
    summary: str

    def factors(self, chosen: Evaluation) -> tuple[float | None, float | None]:
        """The alternative's time and cost over the chosen plan's (None without a plan or a ratio)."""
        if self.evaluation is None:
            return None, None
        return ratio(self.evaluation.iteration_s, chosen.iteration_s), ratio(self.evaluation.cost_usd, chosen.cost_usd)


@dataclass(frozen=True)
class _Family:
    """A family of plans: the problem restricted to it, the block ranges its stages may have (None: any),
    and which plans belong (to pick baselines as the solver's incumbents)."""

    family: AlternativeFamily
    label: str
    description: str
    problem: Problem
    ranges: list[tuple[int, int]] | None
    member: Callable[[Plan], bool]


# --- the terms of one plan ------------------------------------------------------------------------------


def time_terms(problem: Problem, plan: Plan, evaluation: Evaluation) -> dict[str, float]:
    """The plan's iteration time split into TIME_TERMS (they add up to `evaluation.iteration_s`).

    Reads what CostModel.evaluate recorded: the fill is every stage's first micro-batch, each lane's time
    counted (compute; the first stage's data download; the other transfers); the steady term's
    micro-batches (`evaluation.extra`) count on the lane that bounds them in the stages evaluate found
    bounding them (`evaluation.bounding`); the overhang is the end of the critical stage's tail, which
    runs the gradient sync and then the update."""
    parts = dict.fromkeys(TIME_TERMS, 0.0)
    stages = evaluation.stages
    for s, t in enumerate(stages):
        parts["compute"] += t.forward_compute_s + t.backward_compute_s
        parts["data loading" if s == 0 else "stage transfers"] += t.forward_download_s
        parts["stage transfers"] += t.forward_upload_s + t.backward_download_s + t.backward_upload_s
    extra = evaluation.extra

    def download(s: int) -> str:
        return "data loading" if s == 0 else "stage transfers"

    if problem.schedule == "gpipe":
        # max_s (n_s - 1) phi_s: forwards, then max_s (n_s - 1) beta_s: backwards (the drain)
        k, j = evaluation.bounding
        t = stages[k]
        lanes = [("compute", t.forward_compute_s), (download(k), t.forward_download_s)]
        lanes.append(("stage transfers", t.forward_upload_s))
        name, value = max(lanes, key=lambda lane: lane[1])
        parts[name] += extra[k] * value
        t = stages[j]
        lanes = [("compute", t.backward_compute_s), ("stage transfers", t.backward_download_s)]
        lanes.append(("stage transfers", t.backward_upload_s))
        name, value = max(lanes, key=lambda lane: lane[1])
        parts[name] += extra[j] * value
    else:
        # max_s (n_s - 1) c_s: a forward and a backward alternate on each lane
        (j,) = evaluation.bounding
        t = stages[j]
        compute = t.forward_compute_s + t.backward_compute_s
        downloads = t.forward_download_s + t.backward_download_s
        uploads = t.forward_upload_s + t.backward_upload_s
        lane = max((compute, 0), (downloads, 1), (uploads, 2), key=lambda pair: pair[0])[1]
        if lane == 0:
            parts["compute"] += extra[j] * compute
        elif lane == 1:
            parts[download(j)] += extra[j] * t.forward_download_s
            parts["stage transfers"] += extra[j] * t.backward_download_s
        else:
            parts["stage transfers"] += extra[j] * uploads
    # The overhang, the evaluation's own: the last seconds of the critical stage's sync, then update.
    overhang = max(0.0, evaluation.iteration_s - evaluation.pipeline_s)
    update = min(evaluation.update_s, overhang)
    # What is left within rounding of the iteration time is none (iteration = pipeline + 0, or + update).
    for name, seconds in (("optimizer update", update), ("gradient sync", overhang - update)):
        parts[name] += seconds if seconds > TIE * evaluation.iteration_s else 0.0
    return parts


def cost_terms(problem: Problem, plan: Plan, evaluation: Evaluation) -> dict[str, float]:
    """The plan's cost per iteration split into COST_TERMS (they add up to `evaluation.cost_usd`): its
    functions kept alive through each time term, its invocations and its storage requests."""
    rate = problem.region.prices.gb_second * function_gb(plan)
    parts = {name: seconds * rate for name, seconds in time_terms(problem, plan, evaluation).items()}
    parts["invocations"] = evaluation.request_usd
    parts["storage requests"] = evaluation.storage_usd
    return parts


# --- the families -------------------------------------------------------------------------------------


def explain(result: PlanResult, options: PlanOptions) -> tuple[Alternative, ...]:
    """Why `result`'s plan won under `options`' objective and limits: one Alternative per family the
    plan is not in, in the order of the module docstring. Empty across several regions, whose plans share
    a partition chosen for another objective."""
    if result.geo is not None:
        return ()
    problem, solution = result.problem, result.solution
    goal = Goal(options.objective, options.deadline, options.budget)
    unit: Unit = "s" if goal.minimises_time else "USD"
    found = []
    time_limit = min(options.time_limit, EXPLAIN_TIME_LIMIT_S)
    for family in _families(problem, solution.plan, unit, options.replicas):
        if isinstance(family, _Family):
            found.append(_best_of(family, result, goal, time_limit))
        else:
            found.append(family)
    return tuple(found)


def _families(problem: Problem, chosen: Plan, unit: Unit, requested: Sequence[int]) -> list[_Family | Alternative]:
    """The families the chosen plan is not in, or, for one the request leaves empty, why (`unit`: the
    objective's measure; `requested`: the replica counts of --replicas, before the platforms' limits)."""

    def none(family: AlternativeFamily, label: str, description: str, why: str) -> Alternative:
        return Alternative(family, label, description, None, None, True, unit, {}, "", "", f"none considered: {why}")

    n_blocks = len(problem.blocks)
    whole = (0, n_blocks - 1)
    count = len(chosen.stages)
    families: list[_Family | Alternative] = []
    if count == 1:
        if n_blocks > 1 and problem.max_stages > 1:
            every = [(a, b) for a in range(n_blocks) for b in range(a, n_blocks) if (a, b) != whole]
            families.append(
                _Family("pipeline", "A pipeline", "2 or more stages", problem, every, lambda p: len(p.stages) > 1)
            )
        else:
            why = "the model is one block" if n_blocks == 1 else f"{problem.stage_limit_source()} allows 1 stage"
            families.append(none("pipeline", "A pipeline", "2 or more stages", why))
    elif count == 2:
        families.append(
            _Family(
                "data-parallel",
                "Data parallelism",
                "1 stage: the whole model in every function",
                problem,
                [whole],
                lambda p: len(p.stages) == 1,
            )
        )
    else:
        fewer = dataclasses.replace(problem, max_stages=count - 1, min_stages=1)
        families.append(
            _Family(
                "fewer-stages", "Fewer stages", f"at most {count - 1}", fewer, None, lambda p: len(p.stages) < count
            )
        )

    most = max(c.replicas for c in chosen.stages)
    least = min(c.replicas for c in chosen.stages)
    below = tuple(r for r in problem.replicas if r < most)
    allowed = ",".join(map(str, requested))
    description = f"every stage under {most}"
    if most > 1 and not below:
        families.append(none("fewer-replicas", "Fewer replicas", description, f"--replicas {allowed} allows no fewer"))
    elif most > 1:  # (fewer than 1 replica is no plan: nothing to say)
        families.append(
            _Family(
                "fewer-replicas",
                "Fewer replicas",
                description,
                dataclasses.replace(problem, replicas=below),
                None,
                lambda p: all(c.replicas < most for c in p.stages),
            )
        )
    above = tuple(r for r in problem.replicas if r > least)
    description = f"every stage over {least}"
    platform = problem.platform.replicas
    if not above and platform is not None and any(r > least for r in requested):
        left_out = ",".join(str(r) for r in requested if r > least)
        why = f"--replicas {left_out} exceeds {platform.what} ({platform.lift})"
        families.append(none("more-replicas", "More replicas", description, why))
    elif not above:
        families.append(none("more-replicas", "More replicas", description, f"--replicas {allowed} allows no more"))
    elif min(above) > problem.function_limit:
        why = f"{min(above)} functions exceed {problem.function_limit_source()}"
        families.append(none("more-replicas", "More replicas", description, why))
    else:
        families.append(
            _Family(
                "more-replicas",
                "More replicas",
                description,
                dataclasses.replace(problem, replicas=above),
                None,
                lambda p: all(c.replicas > least for c in p.stages),
            )
        )

    region = problem.region
    largest = max(c.tier_mb for c in chosen.stages)
    smallest = min(c.tier_mb for c in chosen.stages)
    # (family, label, its tiers, every stage under or over the bound, the catalog's extreme it would pass)
    sides: list[tuple[AlternativeFamily, str, list[int], str, int, str]] = [
        (
            "smaller-tier",
            "A smaller memory tier",
            [m for m in region.tiers_mb if m < largest],
            "under",
            largest,
            "smallest",
        ),
        (
            "larger-tier",
            "A larger memory tier",
            [m for m in region.tiers_mb if m > smallest],
            "over",
            smallest,
            "largest",
        ),
    ]
    for family, label, tiers, word, bound, extreme in sides:
        description = f"every stage {word} {bound} MB"
        if not tiers:
            families.append(none(family, label, description, f"{bound} MB is the {extreme} tier of {region.name}"))
            continue
        restricted = dataclasses.replace(problem, region=_with_tiers(region, tiers))
        families.append(_Family(family, label, description, restricted, None, _on_tiers(frozenset(tiers))))

    others = tuple(mu for mu in sorted(problem.micro_batch_counts()) if mu != chosen.micro_batch)
    if not others:
        description = f"micro-batch other than {chosen.micro_batch}"
        why = (
            f"{chosen.micro_batch} is the only candidate size (TRAINING['micro_batch_sizes'], else the traced one) "
            f"that divides the global batch {problem.global_batch}"
        )
        families.append(none("micro-batch", "Another micro-batch size", description, why))
    else:
        description = "micro-batch " + ", ".join(map(str, others))
        families.append(
            _Family(
                "micro-batch",
                "Another micro-batch size",
                description,
                dataclasses.replace(problem, micro_batches=others),
                None,
                lambda p: p.micro_batch != chosen.micro_batch,
            )
        )
    return families


def _with_tiers(region: Region, tiers: Sequence[int]) -> Region:
    """The region with only `tiers`, each at the bandwidth it has in `region`: bandwidth is linear in the
    tier between the catalog's smallest and largest tier, so new ends at the kept tiers' bandwidth keep
    every kept tier's (the planner then chooses among them on the same cost model)."""
    low, high = min(tiers), max(tiers)
    return dataclasses.replace(
        region,
        tiers_mb=tuple(sorted(tiers)),
        min_mb_per_s=region.bandwidth_bps(low) / 1e6,
        max_mb_per_s=region.bandwidth_bps(high) / 1e6,
    )


def _on_tiers(allowed: frozenset[int]) -> Callable[[Plan], bool]:
    """Whether a plan's every stage is on one of the `allowed` tiers."""
    return lambda plan: all(c.tier_mb in allowed for c in plan.stages)


def _best_of(family: _Family, result: PlanResult, goal: Goal, time_limit: float) -> Alternative:
    """The family's best plan within the limits, compared with the chosen plan."""
    problem, solution = result.problem, result.solution
    model = CostModel(problem)
    best: tuple[Plan, Evaluation] | None = None
    gap = 0.0  # the family's best is proven (the baseline is by enumeration)
    if family.family == "data-parallel":
        # The data-parallel baseline is, by enumeration, the best plan of one stage.
        for baseline in result.baselines:
            if baseline.name == "data-parallel" and baseline.plan is not None and baseline.evaluation is not None:
                best = baseline.plan, baseline.evaluation
    if best is None:
        incumbents = tuple(b.plan for b in result.baselines if b.plan is not None and family.member(b.plan))
        try:
            found = solve(
                family.problem,
                goal.objective,
                deadline=goal.deadline,
                budget=goal.budget,
                time_limit=time_limit,
                fixed_ranges=family.ranges,
                incumbents=incumbents,
            )
        except Infeasible:
            unit: Unit = "s" if goal.minimises_time else "USD"
            why = _why_empty(family, goal, time_limit)
            return Alternative(family.family, family.label, family.description, None, None, True, unit, {}, "", "", why)
        # Every figure from the request's own cost model (a family's region may differ in rounding).
        best = found.plan, model.evaluate(found.plan)
        gap = found.gap
    return _compare(family, problem, solution, best, gap, goal, time_limit)


def _why_empty(family: _Family, goal: Goal, time_limit: float) -> str:
    """Why a family has no plan within the limits: its fastest plan misses the deadline, its cheapest
    exceeds the budget, or none of its plans fits in memory and the function and stage limits."""
    problem = family.problem
    runs = problem.iterations
    limits: list[tuple[Objective, float | None]] = [("time", goal.deadline), ("cost", goal.budget)]
    for objective, limit in limits:
        if limit is None:
            continue
        try:
            best = solve(problem, objective, time_limit=time_limit, fixed_ranges=family.ranges)
        except Infeasible:
            break
        if objective == "time" and best.evaluation.iteration_s * runs > goal.time_limit():
            return (
                f"no plan meets the deadline: the fastest takes {fmt(best.evaluation.iteration_s * runs)} s per run "
                f"of {runs} iterations, over the deadline of {goal.deadline:g} s"
            )
        if objective == "cost" and best.evaluation.cost_usd * runs > goal.cost_limit():
            return (
                f"no plan fits the budget: the cheapest costs {fmt(best.evaluation.cost_usd * runs)} USD per run "
                f"of {runs} iterations, over the budget of {goal.budget:g} USD"
            )
    if goal.deadline is not None and goal.budget is not None:
        return "no plan meets both the deadline and the budget"
    return "no plan found that fits in memory within the function and stage limits"


def _compare(
    family: _Family,
    problem: Problem,
    solution: Solution,
    best: tuple[Plan, Evaluation],
    gap: float,
    goal: Goal,
    time_limit: float,
) -> Alternative:
    """The alternative against the chosen plan: terms in the objective's measure (the other one when the
    two plans tie on it), the term it loses most by and the one it gains most by, and the sentence;
    `gap` is how far the family's solve proved `best` from the family's optimum (inf: no bound)."""
    chosen, chosen_evaluation = solution.plan, solution.evaluation
    plan, evaluation = best
    measures: list[Unit] = ["s", "USD"] if goal.minimises_time else ["USD", "s"]
    figure = {"s": lambda e: e.iteration_s, "USD": lambda e: e.cost_usd}
    unit = measures[0]
    tied = ties(figure[unit](evaluation), figure[unit](chosen_evaluation))
    if tied:
        unit = measures[1]
    split = time_terms if unit == "s" else cost_terms
    ours, theirs = split(problem, plan, evaluation), split(problem, chosen, chosen_evaluation)
    terms = {name: (ours[name], theirs[name]) for name in ours}
    deltas = {name: a - b for name, (a, b) in terms.items()}
    worst = max(deltas, key=lambda name: deltas[name])  # dict order: the first term wins a tie
    most_saved = min(deltas, key=lambda name: deltas[name])
    # Differences within rounding of the totals are not named.
    noise = NEGLIGIBLE * max(sum(ours.values()), sum(theirs.values()))
    loses_by = worst if deltas[worst] > 0 else ""
    gains_by = most_saved if deltas[most_saved] < -noise else ""
    alternative, mine = figure[unit](evaluation), figure[unit](chosen_evaluation)
    figures = pair(alternative, mine, unit)
    proven = gap <= PROVEN_GAP
    if proven:
        shape = "the best"
    elif math.isfinite(gap):
        shape = f"the best found, within {fmt(100 * gap, 2)} % of the family's best"
    else:
        shape = f"the best found in {fmt(time_limit, 3)} s per micro-batch size"
    shape += ", " + describe_plan(plan)

    def alternative_of(summary: str, loses: str = "", gains: str = "") -> Alternative:
        return Alternative(
            family.family,
            family.label,
            family.description,
            plan,
            evaluation,
            proven,
            unit,
            terms,
            loses,
            gains,
            summary,
        )

    same = "as fast" if unit == "USD" else "as cheap"  # the measure the two plans tie on
    if tied and ties(alternative, mine):
        return alternative_of(f"{shape}, is as fast and as cheap: the planner's pick among equals")
    if alternative < mine and tied:
        # The planner minimises the objective's measure alone, and picks among plans that tie on it.
        better = "faster" if unit == "s" else "cheaper"
        return alternative_of(
            f"{shape}, is {same} and {better} ({figures[0]} against {figures[1]} per iteration): the planner "
            f"minimises the objective alone, on which the two tie",
            gains=gains_by,
        )
    if alternative < mine and not problem.min_stages <= len(plan.stages) <= problem.max_stages:
        # --stages fixed the count (or --max-stages bounded it): the plan was excluded, not missed
        return alternative_of(
            f"{shape}, is better ({figures[0]} against {figures[1]} per iteration), with "
            f"{len(plan.stages)} stage{'s' if len(plan.stages) > 1 else ''}: "
            + (
                f"--stages {problem.min_stages}"
                if len(plan.stages) < problem.min_stages
                else problem.stage_limit_source()
            )
            + " ruled it out",
            gains=gains_by,
        )
    if alternative < mine:
        # Only when the plan's solve stopped at its time limit before it found this plan.
        return alternative_of(
            f"{shape}, is better ({figures[0]} against {figures[1]} per iteration): the planner stopped at its "
            f"time limit (gap {fmt(100 * solution.gap, 3)} %) before it found it",
            gains=gains_by,
        )
    factor = as_factor(alternative / mine) if mine > 0 else "infinitely"
    verdict = f"takes {factor} as long" if unit == "s" else f"costs {factor} as much"
    if tied:
        verdict = f"is {same} but {verdict}"
    summary = f"{shape}, {verdict} per iteration ({figures[0]} against {figures[1]}): "
    summary += loss_text(loses_by, terms[loses_by], unit, problem, best, (chosen, chosen_evaluation))
    # The other terms it loses by, and what it saves: with the first, they make the whole difference.
    by_size = sorted(deltas, key=lambda name: -abs(deltas[name]))  # stable: TERMS order among equals
    more = [name for name in by_size if name != loses_by and deltas[name] > noise]
    if more:
        summary += f", and {amount(sum(deltas[name] for name in more), unit)} more in {listed(more)}"
    saved = [name for name in by_size if deltas[name] < -noise]
    if saved:
        summary += f"; it saves {amount(-deltas[saved[0]], unit)} in {saved[0]}"
        if saved[1:]:
            summary += f" and {amount(-sum(deltas[name] for name in saved[1:]), unit)} in {listed(saved[1:])}"
    return alternative_of(summary, loses_by, gains_by)


# --- plan.json and the summary ------------------------------------------------------------------------


def _round(value: float, digits: int = 9) -> float:
    """As plan.json rounds its figures: the last bits of a float do not change the file."""
    return float(f"{value:.{digits}g}")


def alternatives_ir(alternatives: Sequence[Alternative], chosen: Evaluation) -> tuple[AlternativeDocument, ...]:
    """The explanation as plan.json holds it."""
    documents = []
    for a in alternatives:
        time_factor, cost_factor = a.factors(chosen)
        documents.append(
            AlternativeDocument(
                family=a.family,
                label=a.label,
                description=a.description,
                micro_batch=None if a.plan is None else a.plan.micro_batch,
                proven=a.proven,
                stages=()
                if a.plan is None
                else tuple(AlternativeStage((c.first, c.last), c.tier_mb, c.replicas) for c in a.plan.stages),
                iteration_s=None if a.evaluation is None else _round(a.evaluation.iteration_s),
                cost_usd=None if a.evaluation is None else _round(a.evaluation.cost_usd),
                time_factor=None if time_factor is None else _round(time_factor, 6),
                cost_factor=None if cost_factor is None else _round(cost_factor, 6),
                unit=a.unit,
                terms=tuple(PlanTerm(name, _round(ours), _round(theirs)) for name, (ours, theirs) in a.terms.items()),
                loses_by=a.loses_by,
                gains_by=a.gains_by,
                summary=a.summary,
            )
        )
    return tuple(documents)


def summary_line(plan: TrainingPlan) -> str | None:
    """The CLI's line for plan.json's explanation (None without one): each other family's best, its time
    (or cost, by the objective) over this plan's and the term it loses most by; then the families with none."""
    if not plan.explanation:
        return None
    unit: Unit = "s" if plan.objective in ("time", "time-under-budget") else "USD"
    found, empty = [], []
    for a in plan.explanation:
        factor = a.time_factor if a.unit == "s" else a.cost_factor
        if a.micro_batch is None:
            empty.append(a.family)
            continue
        text = f"{a.family} " + ("n/a" if factor is None else as_factor(factor))
        if a.unit != unit:  # tied on the objective's measure: the other one
            text += " time" if a.unit == "s" else " cost"
        found.append(text + (f" ({a.loses_by})" if a.loses_by else ""))
    measure = "time" if unit == "s" else "cost"
    line = f"best of each other family, {measure} over this plan's: " + (", ".join(found) or "-")
    return line + (f"; none: {', '.join(empty)}" if empty else "")
