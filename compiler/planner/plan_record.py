"""The plan as plan.json records it (`plan_ir`): the chosen stages with their terms, the predicted and
simulated figures, the baselines, the solver's status and, across several regions, each region's
schedule; from a finished PlanResult, whose planning is done."""

from __future__ import annotations

import dataclasses
import math
import typing

from ...ir import BlockChain
from ...ir.plan import (
    BaselinePlan,
    DataMove,
    Figures,
    FrontierPoint,
    PlannedStage,
    RegionsBaseline,
    RegionSchedule,
    RegionsSolverReport,
    SiteSchedule,
    SolverReport,
    SolverStatus,
    Totals,
    TrainingPlan,
)
from ...ir.timeline import Timeline
from .baselines import ratio
from .cost_model import (
    Evaluation,
    Plan,
    Problem,
)
from .explain import alternatives_ir, explain
from .geo import (
    region_shares,
)
from .plan import GeoResult, PlanOptions, PlanResult
from .simulate import simulate


def _round(value: float, digits: int = 9) -> float:
    """Round figures so that plan.json does not change with the last bits of a float."""
    return float(f"{value:.{digits}g}")


def _stages(plan: Plan, evaluation: Evaluation, chain: BlockChain) -> tuple[PlannedStage, ...]:
    stages = []
    for index, (choice, terms) in enumerate(zip(plan.stages, evaluation.stages, strict=True)):
        modules: list[str] = []
        for block in chain.blocks[choice.first : choice.last + 1]:
            for name in block.modules:
                if name not in modules:
                    modules.append(name)
        stages.append(
            PlannedStage(
                index=index,
                blocks=(choice.first, choice.last),
                modules=tuple(modules),
                tier_mb=choice.tier_mb,
                replicas=choice.replicas,
                memory_mb=_round(terms.memory_mb, 6),
                forward_s=_round(terms.forward_s),
                backward_s=_round(terms.backward_s),
                sync_s=_round(terms.sync_s),
                update_s=_round(terms.update_s),
            )
        )
    return tuple(stages)


def _figures(problem: Problem, evaluation: Evaluation, simulated_s: float) -> Figures:
    per_epoch = None
    if problem.samples_per_epoch:
        iterations = max(1, math.ceil(problem.samples_per_epoch / problem.global_batch))
        per_epoch = Totals(
            iterations=iterations,
            time_s=_round(evaluation.iteration_s * iterations),
            cost_usd=_round(evaluation.cost_usd * iterations),
        )
    return Figures(
        iteration_s=_round(evaluation.iteration_s),
        simulated_iteration_s=_round(simulated_s),
        cost_usd=_round(evaluation.cost_usd),
        pipeline_s=_round(evaluation.pipeline_s),
        sync_s=_round(evaluation.sync_s),
        update_s=_round(evaluation.update_s),
        compute_usd=_round(evaluation.compute_usd),
        request_usd=_round(evaluation.request_usd),
        storage_usd=_round(evaluation.storage_usd),
        per_run=Totals(
            iterations=problem.iterations,
            time_s=_round(evaluation.iteration_s * problem.iterations),
            cost_usd=_round(evaluation.cost_usd * problem.iterations),
        ),
        per_epoch=per_epoch,
        warnings=tuple(evaluation.warnings),
    )


def _status(status: str) -> SolverStatus:
    """A solver's status as plan.json names it (the solvers end with a plan or raise)."""
    if status not in typing.get_args(SolverStatus):
        raise ValueError(f"solver status {status!r}; plan.json knows {typing.get_args(SolverStatus)}")
    return typing.cast(SolverStatus, status)


def _gap(gap: float) -> float | None:
    """The solver's gap as written: None when it proved no bound."""
    return None if math.isinf(gap) else _round(gap, 6)


def plan_record(result: PlanResult, chain: BlockChain, options: PlanOptions, timeline: Timeline) -> TrainingPlan:
    """The plan pass's finished record: the plan as plan.json holds it, its baselines simulated and, in
    one region, why it wins (each other family's best plan, solved on the same cost model)."""
    record = plan_ir(result, chain, options, timeline)
    if result.geo is not None:
        return record
    return dataclasses.replace(
        record, explanation=alternatives_ir(explain(result, options), result.solution.evaluation)
    )


def plan_ir(result: PlanResult, chain: BlockChain, options: PlanOptions, timeline: Timeline) -> TrainingPlan:
    """The plan as plan.json holds it (`cloudless.ir.files.plan_text` checks it against its schema);
    `timeline` is the chosen plan's simulated iteration (simulated once, by the caller)."""
    solution, problem = result.solution, result.problem
    chosen = solution.evaluation
    found = []
    for b in result.baselines:
        if b.plan is not None and b.evaluation is not None:
            time_ratio, cost_ratio = b.ratios(chosen)
            found.append(
                BaselinePlan(
                    name=b.name,
                    description=b.description,
                    feasible=True,
                    reason=b.reason,
                    micro_batch=b.plan.micro_batch,
                    stages=_stages(b.plan, b.evaluation, chain),
                    predicted=_figures(problem, b.evaluation, simulate(problem, b.plan).iteration_s),
                    time_ratio=None if time_ratio is None else _round(time_ratio, 6),
                    cost_ratio=None if cost_ratio is None else _round(cost_ratio, 6),
                )
            )
        else:
            found.append(BaselinePlan(b.name, b.description, False, b.reason, None, (), None, None, None))
    return TrainingPlan(
        model=chain.model,
        region=result.region.name,
        objective=options.objective,
        schedule=problem.schedule,
        deadline_s=options.deadline,
        budget_usd=options.budget,
        global_batch=problem.global_batch,
        micro_batch=solution.plan.micro_batch,
        micro_batches=problem.global_batch // solution.plan.micro_batch,
        stages=_stages(solution.plan, chosen, chain),
        predicted=_figures(problem, chosen, timeline.iteration_s),
        solver=SolverReport(
            name=solution.solver,
            status=_status(solution.status),
            gap=_gap(solution.gap),
            time_limit_s=options.time_limit,
            candidates={str(k): v for k, v in sorted(solution.candidates.items())},
        ),
        baselines=tuple(found),
        regions=None if result.geo is None else _region_schedule(result.geo, chain),
    )


def _region_schedule(geo: GeoResult, chain: BlockChain) -> RegionSchedule:
    problem, solution = geo.problem, geo.solution
    chosen = solution.evaluation
    runs = {share.site: share.iterations for share in region_shares(problem, solution.plan)}
    sites = []
    for r, site in enumerate(problem.sites):
        figures = chosen.regions[r]
        region_result = geo.regions[r]
        planned = region_result.solution if region_result is not None else None
        sites.append(
            SiteSchedule(
                name=site.name,
                data_samples=site.data,
                trains=figures is not None,
                samples=_round(figures.data if figures else 0.0),
                iterations=_round(figures.iterations if figures else 0.0),
                runs_iterations=runs.get(r),
                stages=_stages(planned.plan, planned.evaluation, chain) if planned is not None else (),
                iteration_s=_round(planned.evaluation.iteration_s) if planned is not None else None,
                move_in_s=_round(figures.move_in_s if figures else 0.0),
                work_s=_round(figures.work_s if figures else 0.0),
                sync_s=_round(figures.sync_s if figures else 0.0),
                cost_usd=_round(
                    figures.compute_usd + figures.fixed_usd + figures.sync_usd + figures.move_usd if figures else 0.0
                ),
                frontier=tuple(
                    FrontierPoint(iteration_s=_round(o.iteration_s), cost_usd=_round(o.compute_usd + o.fixed_usd))
                    for o in site.options
                ),
            )
        )
    baselines = []
    for b in geo.baselines:
        found = b.solution.evaluation if b.solution is not None else None
        time_ratio = ratio(chosen.training_s, found.training_s) if found else None
        cost_ratio = ratio(chosen.cost_usd, found.cost_usd) if found else None
        baselines.append(
            RegionsBaseline(
                name=b.name,
                description=b.description,
                feasible=found is not None,
                reason=b.reason,
                training_s=_round(found.training_s) if found else None,
                cost_usd=_round(found.cost_usd) if found else None,
                time_ratio=None if time_ratio is None else _round(time_ratio, 6),
                cost_ratio=None if cost_ratio is None else _round(cost_ratio, 6),
            )
        )
    server = solution.plan.server
    return RegionSchedule(
        sync=problem.sync,
        sync_every=problem.sync_every,
        rounds=problem.rounds,
        server=problem.sites[server].name if server is not None else None,
        training_s=_round(chosen.training_s),
        cost_usd=_round(chosen.cost_usd),
        solver=RegionsSolverReport(status=_status(solution.status), gap=_gap(solution.gap)),
        sites=tuple(sites),
        moves=tuple(
            DataMove(
                from_region=problem.sites[a].name,
                to_region=problem.sites[b].name,
                samples=_round(problem.sites[a].data * parts / problem.parts),
            )
            for (a, b), parts in solution.plan.moves
        ),
        baselines=tuple(baselines),
    )
