"""The planning pass: block chain + catalog + training settings -> the chosen plan and baselines.

When nothing fits, one error names the tightest bound and what would make the request feasible.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from cloudless.compiler.baselines import Baseline, baselines
from cloudless.compiler.cost_model import (
    MB,
    CostModel,
    Evaluation,
    Objective,
    Plan,
    Problem,
    Schedule,
    StageChoice,
    problem_from_chain,
)
from cloudless.compiler.errors import CompileError
from cloudless.compiler.model_file import ModelFile
from cloudless.compiler.planner import Infeasible, Solution, check_objective, solve, stage_configs
from cloudless.compiler.simulate import simulate
from cloudless.ir import BlockChain
from cloudless.ir.catalog import Catalog, Region, load_catalog
from cloudless.ir.schema import SchemaError


class PlanInfeasible(CompileError):
    """No plan satisfies the request."""


@dataclass
class PlanOptions:
    catalog: Path | None = None
    region: str | None = None
    objective: Objective = "cost"
    deadline: float | None = None
    budget: float | None = None
    max_functions: int | None = None
    schedule: Schedule = "gpipe"
    max_stages: int = 16
    replicas: tuple[int, ...] = (1, 2, 4, 8)
    time_limit: float = 10.0


@dataclass
class PlanResult:
    region: Region
    problem: Problem
    solution: Solution
    baselines: list[Baseline] = field(default_factory=list)


def optimizer_state_factor(model_file: ModelFile) -> int:
    """Optimizer state per parameter: 2 for Adam-style, 1 for SGD with momentum, else 0."""
    if model_file.make_optimizer is None:
        return 0
    probe = torch.nn.Parameter(torch.zeros(1))
    optimizer = model_file.call("make_optimizer", [probe])
    if isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW | torch.optim.Adamax | torch.optim.NAdam):
        return 2
    momentum = optimizer.param_groups[0].get("momentum", 0) or 0
    return 1 if momentum else 0


def build_problem(chain: BlockChain, model_file: ModelFile, options: PlanOptions) -> tuple[Region, Problem]:
    try:
        catalog: Catalog = load_catalog(options.catalog)
        region = catalog.region(options.region)
    except SchemaError as exc:
        raise CompileError(str(exc)) from exc
    training = model_file.training
    micro_batches = tuple(training.get("micro_batch_sizes") or [chain.batch_size])
    global_batch = training.get("global_batch_size") or max(micro_batches) * 8
    usable = [mu for mu in micro_batches if global_batch % mu == 0]
    if not usable:
        raise CompileError(
            f"{model_file.name}: TRAINING['micro_batch_sizes'] {list(micro_batches)}: none divides "
            f"global_batch_size {global_batch}"
        )
    problem = problem_from_chain(
        chain,
        region,
        global_batch=global_batch,
        micro_batches=tuple(usable),
        schedule=options.schedule,
        optimizer_state=optimizer_state_factor(model_file),
        replicas=options.replicas,
        max_stages=options.max_stages,
        max_functions=options.max_functions,
        iterations=int(training.get("iterations") or 1),
        samples_per_epoch=_samples_per_epoch(model_file, region.name),
    )
    return region, problem


def _samples_per_epoch(model_file: ModelFile, region: str) -> int | None:
    """The training split's size in this region, when the model file says where data lies."""
    if model_file.load_shard is None:
        return None
    shard = model_file.call("load_shard", region, "train")
    try:
        return len(shard)
    except TypeError:
        return None


def plan_training(chain: BlockChain, model_file: ModelFile, options: PlanOptions) -> PlanResult:
    region, problem = build_problem(chain, model_file, options)
    try:
        check_objective(options.objective, options.deadline, options.budget)
    except ValueError as exc:
        raise CompileError(str(exc)) from exc
    found = baselines(problem, options.objective, deadline=options.deadline, budget=options.budget)
    incumbents = tuple(b.plan for b in found if b.plan is not None)
    try:
        solution = solve(
            problem,
            options.objective,
            deadline=options.deadline,
            budget=options.budget,
            time_limit=options.time_limit,
            incumbents=incumbents,
        )
    except Infeasible as exc:
        raise PlanInfeasible(diagnose(problem, options)) from exc
    return PlanResult(region, problem, solution, found)


def diagnose(problem: Problem, options: PlanOptions) -> str:
    """The tightest bound that makes the request infeasible, and what would lift it."""
    model = CostModel(problem)
    region = problem.region
    largest = max(region.tiers_mb)
    mu = min(problem.micro_batch_counts())
    most_replicas = max(problem.replicas)
    n = len(problem.blocks)
    # 1. All the model's state against every function the limit allows.
    state_mb = (
        sum((2 + problem.optimizer_state) * b.param_bytes + b.buffer_bytes for b in problem.blocks) / MB
        + sum(problem.shared_bytes.values()) * (2 + problem.optimizer_state) / MB
    )
    functions = problem.function_limit
    stages = min(problem.max_stages, n)
    capacity = min(functions, stages) * (largest - region.runtime_overhead_mb)
    if state_mb > capacity:
        return (
            f"no plan fits: the model's parameters, gradients and optimizer state need {state_mb / 1024:.1f} GB, "
            f"but {min(functions, stages)} functions of {largest} MB hold {capacity / 1024:.1f} GB after the "
            f"runtime's {region.runtime_overhead_mb:.0f} MB each; allow more functions (--max-functions) or stages "
            f"(--max-stages), or use an optimizer with less state"
        )
    # 2. A block that fits no function even alone, with the most replicas, at the smallest micro-batch.
    n = len(problem.blocks)
    covered = {
        b
        for mu_ in problem.micro_batch_counts()
        for c, _, _ in stage_configs(problem, mu_)
        for b in range(c.first, c.last + 1)
    }
    for b in range(n):
        if b not in covered:
            terms = model.stage_terms(StageChoice(b, b, largest, most_replicas), min(b, 1), 3, mu)
            return (
                f"no plan fits: block {b} alone needs {terms.memory_mb:.0f} MB on the largest function "
                f"({largest} MB in {region.name}) at micro-batch {mu}; use a smaller micro-batch, more blocks "
                "(--blocks), the 1F1B schedule (--schedule 1f1b), or a region with larger functions"
            )
    # 3. The deadline against the fastest plan, the budget against the cheapest.
    if options.deadline is not None:
        try:
            fastest = solve(problem, "time", time_limit=options.time_limit)
            run_s = fastest.evaluation.iteration_s * problem.iterations
            if run_s > options.deadline:
                return (
                    f"no plan meets the deadline: the fastest plan takes {run_s:.1f} s for {problem.iterations} "
                    f"iterations ({fastest.evaluation.iteration_s:.2f} s each), "
                    f"above --deadline {options.deadline:g} s; "
                    f"raise the deadline to at least {math.ceil(run_s)} s or allow more functions"
                )
        except Infeasible:
            pass
    if options.budget is not None:
        try:
            cheapest = solve(problem, "cost", time_limit=options.time_limit)
            run_usd = cheapest.evaluation.cost_usd * problem.iterations
            if run_usd > options.budget:
                return (
                    f"no plan fits the budget: the cheapest plan costs {run_usd:.4f} USD for {problem.iterations} "
                    f"iterations, above --budget {options.budget:g} USD; raise the budget to at least "
                    f"{run_usd:.4f} USD"
                )
        except Infeasible:
            pass
    return (
        f"no plan fits within {functions} functions and {stages} stages in {region.name}; allow more functions "
        "(--max-functions) or stages (--max-stages)"
    )


def _round(value: float, digits: int = 9) -> float:
    """Round figures so that plan.json does not change with the last bits of a float."""
    return float(f"{value:.{digits}g}")


def _stage_documents(plan, evaluation, chain: BlockChain) -> list[dict]:
    stages = []
    for index, (choice, terms) in enumerate(zip(plan.stages, evaluation.stages, strict=True)):
        modules: list[str] = []
        for block in chain.blocks[choice.first : choice.last + 1]:
            for name in block.modules:
                if name not in modules:
                    modules.append(name)
        stages.append(
            {
                "index": index,
                "blocks": [choice.first, choice.last],
                "modules": modules,
                "tier_mb": choice.tier_mb,
                "replicas": choice.replicas,
                "memory_mb": _round(terms.memory_mb, 6),
                "forward_s": _round(terms.forward_s),
                "backward_s": _round(terms.backward_s),
                "sync_s": _round(terms.sync_s),
                "update_s": _round(terms.update_s),
            }
        )
    return stages


def _figures(problem: Problem, plan: Plan, evaluation: Evaluation) -> dict:
    per_epoch = None
    if problem.samples_per_epoch:
        iterations = max(1, math.ceil(problem.samples_per_epoch / problem.global_batch))
        per_epoch = {
            "iterations": iterations,
            "time_s": _round(evaluation.iteration_s * iterations),
            "cost_usd": _round(evaluation.cost_usd * iterations),
        }
    return {
        "iteration_s": _round(evaluation.iteration_s),
        "simulated_iteration_s": _round(simulate(problem, plan).iteration_s),
        "cost_usd": _round(evaluation.cost_usd),
        "pipeline_s": _round(evaluation.pipeline_s),
        "sync_s": _round(evaluation.sync_s),
        "update_s": _round(evaluation.update_s),
        "compute_usd": _round(evaluation.compute_usd),
        "request_usd": _round(evaluation.request_usd),
        "storage_usd": _round(evaluation.storage_usd),
        "per_run": {
            "iterations": problem.iterations,
            "time_s": _round(evaluation.iteration_s * problem.iterations),
            "cost_usd": _round(evaluation.cost_usd * problem.iterations),
        },
        "per_epoch": per_epoch,
        "warnings": list(evaluation.warnings),
    }


def plan_document(result: PlanResult, chain: BlockChain, options: PlanOptions) -> dict:
    """plan.json's content (validated against ir/schemas/plan.schema.json when saved)."""
    solution, problem = result.solution, result.problem
    chosen = solution.evaluation
    baseline_docs = []
    for b in result.baselines:
        feasible = b.plan is not None and b.evaluation is not None
        baseline_docs.append(
            {
                "name": b.name,
                "description": b.description,
                "feasible": feasible,
                "reason": b.reason,
                "micro_batch": b.plan.micro_batch if feasible else None,
                "stages": _stage_documents(b.plan, b.evaluation, chain) if feasible else [],
                "predicted": _figures(problem, b.plan, b.evaluation) if feasible else None,
                "time_ratio": _round(b.ratios(chosen)[0], 6) if feasible else None,
                "cost_ratio": _round(b.ratios(chosen)[1], 6) if feasible else None,
            }
        )
    return {
        "apiVersion": "cloudless/v1",
        "kind": "Plan",
        "model": chain.model,
        "region": result.region.name,
        "objective": options.objective,
        "schedule": problem.schedule,
        "deadline_s": options.deadline,
        "budget_usd": options.budget,
        "global_batch": problem.global_batch,
        "micro_batch": solution.plan.micro_batch,
        "micro_batches": problem.global_batch // solution.plan.micro_batch,
        "stages": _stage_documents(solution.plan, chosen, chain),
        "predicted": _figures(problem, solution.plan, chosen),
        "solver": {
            "name": solution.solver,
            "status": solution.status,
            "gap": None if math.isinf(solution.gap) else _round(solution.gap, 6),
            "time_limit_s": options.time_limit,
            "candidates": {str(k): v for k, v in sorted(solution.candidates.items())},
        },
        "baselines": baseline_docs,
    }
