"""Why the chosen plan won (compiler/planner/explain.py): on real compiles of small models with their golden
profiles, each family's alternative is that family's best plan (checked by enumeration), its figures are
the cost model's evaluation of it, and the term it loses by is the one the cost model's terms say; the
report, plan.json and the CLI say the same."""

from __future__ import annotations

import itertools
import json
import math
import random
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from cloudless.codegen.numbers import fmt
from cloudless.codegen.report import render_markdown
from cloudless.compiler.pipeline import FrontEnd, FrontEndOptions, run_front_end
from cloudless.compiler.planner.baselines import baselines
from cloudless.compiler.planner.cost_model import CostModel, Evaluation, Plan, Problem, StageChoice
from cloudless.compiler.planner.exhaustive import best_plan, contiguous_ranges
from cloudless.compiler.planner.explain import (
    Alternative,
    alternatives_ir,
    cost_terms,
    explain,
    time_terms,
)
from cloudless.compiler.planner.explain_text import COST_TERMS, TIME_TERMS
from cloudless.compiler.planner.pipeline_milp import solve
from cloudless.compiler.planner.pipeline_program import Infeasible, objective_key
from cloudless.compiler.planner.plan import PlanOptions, PlanResult, plan_training
from cloudless.ir.files import load_plan
from cloudless.ir.timeline import Timeline

from .conftest import MODELS, ROOT, SAMPLES
from .planning_cases import random_plan, random_problem

GOLDEN = ROOT / "tests" / "golden"
DIGITS = SAMPLES / "mlp_digits.py"
WIDE = MODELS / "wide_mlp.py"
#: SAM alone: no OpenFaaS CE replica limit, so the fastest wide_mlp plan pipelines over 8 replicas per stage
SAM = frozenset({"sam"})


@pytest.fixture(scope="module")
def digits() -> FrontEnd:
    return run_front_end(FrontEndOptions(DIGITS, profile_from=GOLDEN / "mlp_digits" / "ir" / "blocks.json"))


@pytest.fixture(scope="module")
def wide() -> FrontEnd:
    return run_front_end(
        FrontEndOptions(WIDE, num_blocks=8, profile_from=GOLDEN / "wide_mlp_time" / "ir" / "blocks.json")
    )


def planned(front: FrontEnd, options: PlanOptions) -> tuple[PlanResult, dict[str, Alternative]]:
    result = plan_training(front.chain, front.model_file, options)
    return result, {a.family: a for a in explain(result, options)}


def plans(problem: Problem, stages: Sequence[int], tiers: Sequence[int], replicas: Sequence[int]) -> Iterator[Plan]:
    """Every plan of these stage counts, tiers and replica counts, at every micro-batch size."""
    options = [(m, r) for m in tiers for r in replicas]
    for mu in sorted(problem.micro_batch_counts()):
        for count in stages:
            for ranges in contiguous_ranges(len(problem.blocks), count):
                for picks in itertools.product(options, repeat=count):
                    yield Plan(mu, tuple(StageChoice(a, b, m, r) for (a, b), (m, r) in zip(ranges, picks, strict=True)))


def enumerated(problem: Problem, objective: str, candidates: Iterator[Plan], **limits: float) -> Evaluation:
    found = best_plan(problem, objective, candidates, **limits)  # type: ignore[arg-type]
    assert found is not None
    return found[1]


def check_figures(problem: Problem, result: PlanResult, alternative: Alternative) -> Evaluation:
    """The alternative's figures are the cost model's, its terms add up to them, and the chosen plan's
    terms are the chosen plan's."""
    assert alternative.plan is not None and alternative.evaluation is not None
    evaluation = CostModel(problem).evaluate(alternative.plan)
    assert alternative.evaluation.iteration_s == pytest.approx(evaluation.iteration_s, rel=1e-12)
    assert alternative.evaluation.cost_usd == pytest.approx(evaluation.cost_usd, rel=1e-12)
    chosen = result.solution.evaluation
    total, mine = (
        (evaluation.iteration_s, chosen.iteration_s)
        if alternative.unit == "s"
        else (
            evaluation.cost_usd,
            chosen.cost_usd,
        )
    )
    assert sum(a for a, _ in alternative.terms.values()) == pytest.approx(total, rel=1e-9)
    assert sum(b for _, b in alternative.terms.values()) == pytest.approx(mine, rel=1e-9)
    return evaluation


def test_data_parallelism_wins_and_each_other_family_loses_by_its_own_term(digits: FrontEnd) -> None:
    """mlp_digits for time: one function of 10 GB. A pipeline's activations and gradients cost a 20 ms
    request each way per micro-batch, far more than the compute they split; a second replica's
    scatter-reduce costs requests too; a smaller tier has fewer vCPUs."""
    options = PlanOptions(objective="time")
    result, found = planned(digits, options)
    problem, chosen = result.problem, result.solution
    assert [(c.first, c.last, c.tier_mb, c.replicas) for c in chosen.plan.stages] == [(0, 4, 10240, 1)]
    assert list(found) == ["pipeline", "more-replicas", "smaller-tier", "larger-tier", "micro-batch"]
    n_blocks = len(problem.blocks)
    every = range(1, n_blocks + 1)
    # The time objective needs only each family's largest tier: a larger tier is never slower.
    families = {
        "pipeline": plans(problem, range(2, n_blocks + 1), [10240], problem.replicas),
        "more-replicas": plans(problem, every, [10240], [r for r in problem.replicas if r > 1]),
        "smaller-tier": plans(problem, every, [9216], problem.replicas),
        "micro-batch": (p for p in plans(problem, every, [10240], problem.replicas) if p.micro_batch == 16),
    }
    for family, candidates in families.items():
        alternative = found[family]
        evaluation = check_figures(problem, result, alternative)
        best = enumerated(problem, "time", candidates)
        assert evaluation.iteration_s == pytest.approx(best.iteration_s, rel=1e-9), family
        assert alternative.proven

    # The chosen plan computes its 8 micro-batches one after another: compute is 8 forwards and backwards.
    stage = chosen.evaluation.stages[0]
    pipeline = found["pipeline"]
    assert pipeline.terms["compute"][1] == pytest.approx(8 * (stage.forward_compute_s + stage.backward_compute_s))
    assert pipeline.terms["stage transfers"][1] == 0 and pipeline.terms["gradient sync"][1] == 0
    assert pipeline.loses_by == "stage transfers" and pipeline.terms["stage transfers"][0] > 0.1
    assert pipeline.plan is not None and pipeline.evaluation is not None
    factor = pipeline.evaluation.iteration_s / chosen.evaluation.iteration_s
    assert factor > 10
    assert f"takes {fmt(factor, 3)}× as long per iteration" in pipeline.summary
    # Its micro-batches after the first wait on their transfers (a request each way), not on compute: the
    # compute term is the first micro-batch's alone, the transfers term the first's and the steady
    # forwards and backwards, max_s (n_s - 1) phi_s + max_s (n_s - 1) beta_s (docs/cost_model.md).
    terms = pipeline.evaluation.stages
    micro_batches = problem.global_batch // pipeline.plan.micro_batch
    extra = [math.ceil(micro_batches / c.replicas) - 1 for c in pipeline.plan.stages]
    assert all(t.forward_s > t.forward_compute_s and t.backward_s > t.backward_compute_s for t in terms)
    assert terms[0].forward_s == terms[0].forward_upload_s  # the first stage's activations, not its data
    fill = sum(t.forward_upload_s + t.backward_download_s + t.backward_upload_s for t in terms)
    fill += sum(t.forward_download_s for t in terms[1:])
    steady = max(e * t.forward_s for e, t in zip(extra, terms, strict=True))
    steady += max(e * t.backward_s for e, t in zip(extra, terms, strict=True))
    assert pipeline.terms["stage transfers"][0] == pytest.approx(fill + steady, rel=1e-12)
    assert pipeline.terms["compute"][0] == pytest.approx(sum(t.forward_compute_s + t.backward_compute_s for t in terms))
    # What crosses its cut per micro-batch, from the profile itself.
    cut = pipeline.plan.stages[0].last
    scale = pipeline.plan.micro_batch / digits.chain.batch_size
    size = scale * digits.chain.blocks[cut].output_bytes / 1024
    assert f"{fmt(size, 3)} KB of activations per micro-batch over one cut" in pipeline.summary

    # A second replica's scatter-reduce is the whole tail of a one-stage plan: its closed form.
    replicas = found["more-replicas"]
    assert replicas.loses_by == "gradient sync"
    assert replicas.plan is not None and replicas.evaluation is not None and len(replicas.plan.stages) == 1
    assert replicas.terms["gradient sync"][0] == pytest.approx(replicas.evaluation.stages[0].sync_s, rel=1e-9)

    assert found["smaller-tier"].loses_by == "compute"
    assert found["larger-tier"].plan is None
    assert found["larger-tier"].summary == "none considered: 10240 MB is the largest tier of aws-us-east-1"
    # The same inputs, the same explanation.
    again = explain(result, options)
    assert alternatives_ir(again, chosen.evaluation) == alternatives_ir(tuple(found.values()), chosen.evaluation)


def test_a_pipeline_wins_and_data_parallelism_loses_by_its_gradient_sync(wide: FrontEnd) -> None:
    """wide_mlp for time: two stages of 8 × 10 GB. The best data-parallel plan scatter-reduces all 24 MB
    of gradients among 8 replicas; each of the pipeline's stages syncs half of them, which outweighs
    the activations the pipeline sends between its stages."""
    result, found = planned(wide, PlanOptions(objective="time", targets=SAM))
    problem, chosen = result.problem, result.solution
    assert len(chosen.plan.stages) == 2 and {c.replicas for c in chosen.plan.stages} == {8}
    assert list(found) == [
        "data-parallel",
        "fewer-replicas",
        "more-replicas",
        "smaller-tier",
        "larger-tier",
        "micro-batch",
    ]
    parallel = found["data-parallel"]
    evaluation = check_figures(problem, result, parallel)
    # It is the best plan of one stage, by enumeration, and the data-parallel baseline's.
    one_stage = plans(problem, [1], problem.region.tiers_mb, problem.replicas)
    assert evaluation.iteration_s == pytest.approx(enumerated(problem, "time", one_stage).iteration_s, rel=1e-12)
    (baseline,) = [b for b in result.baselines if b.name == "data-parallel"]
    assert baseline.evaluation is not None and baseline.evaluation.iteration_s == evaluation.iteration_s

    assert parallel.loses_by == "gradient sync" and parallel.gains_by == "stage transfers"
    sync, chosen_sync = parallel.terms["gradient sync"]
    assert sync == pytest.approx(evaluation.stages[0].sync_s, rel=1e-9)
    ours = chosen.evaluation
    assert chosen_sync == pytest.approx(ours.iteration_s - ours.pipeline_s - ours.update_s, rel=1e-9)
    assert parallel.terms["stage transfers"][0] == 0 < parallel.terms["stage transfers"][1]
    factor = evaluation.iteration_s / ours.iteration_s
    assert 1 < factor < 1.1
    assert f"takes {fmt(factor, 3)}× as long per iteration" in parallel.summary
    assert f"gradient sync takes {fmt(sync - chosen_sync, 3)} s more" in parallel.summary

    for family in ("fewer-replicas", "smaller-tier", "micro-batch"):
        check_figures(problem, result, found[family])
        key = objective_key(problem, "time", found[family].evaluation)  # type: ignore[arg-type]
        assert key >= objective_key(problem, "time", ours), family
    assert all(c.replicas < 8 for c in found["fewer-replicas"].plan.stages)  # type: ignore[union-attr]
    assert all(c.tier_mb < 10240 for c in found["smaller-tier"].plan.stages)  # type: ignore[union-attr]
    assert found["micro-batch"].plan.micro_batch != chosen.plan.micro_batch  # type: ignore[union-attr]
    assert found["more-replicas"].summary == "none considered: --replicas 1,2,4,8 allows no more"


def test_a_family_with_no_plan_within_the_deadline_names_its_fastest(digits: FrontEnd) -> None:
    """Cheapest within 2 s for 200 iterations: no pipeline is that fast; the sentence gives the fastest
    one's run, which enumeration confirms."""
    result, found = planned(digits, PlanOptions(objective="cost-under-deadline", deadline=2.0))
    problem = result.problem
    assert len(result.solution.plan.stages) == 1
    fastest = enumerated(problem, "time", plans(problem, range(2, len(problem.blocks) + 1), [10240], problem.replicas))
    run = fastest.iteration_s * problem.iterations
    assert run > 2
    assert found["pipeline"].plan is None
    assert found["pipeline"].summary == (
        f"no plan meets the deadline: the fastest takes {fmt(run)} s per run of {problem.iterations} iterations, "
        "over the deadline of 2 s"
    )
    # Within the deadline, the families that have plans are compared by cost.
    for alternative in found.values():
        if alternative.plan is not None:
            evaluation = check_figures(problem, result, alternative)
            assert evaluation.iteration_s * problem.iterations <= 2 * (1 + 1e-9)
            assert alternative.unit == "USD" and set(alternative.terms) == set(COST_TERMS)


@pytest.mark.parametrize("seed", range(40))
def test_terms_add_up_to_the_evaluation(seed: int) -> None:
    """On random problems and plans (both schedules, replicated, pipelined): the time terms add up to the
    iteration time and the cost terms to the cost, none negative."""
    problem = random_problem(seed)
    rng = random.Random(seed)
    model = CostModel(problem)
    for _ in range(10):
        plan = random_plan(problem, rng)
        evaluation = model.evaluate(plan)
        seconds = time_terms(problem, plan, evaluation)
        usd = cost_terms(problem, plan, evaluation)
        assert list(seconds) == list(TIME_TERMS) and list(usd) == list(COST_TERMS)
        assert min(seconds.values()) >= 0 and min(usd.values()) >= 0
        assert math.fsum(seconds.values()) == pytest.approx(evaluation.iteration_s, rel=1e-9, abs=1e-15)
        assert math.fsum(usd.values()) == pytest.approx(evaluation.cost_usd, rel=1e-9, abs=1e-15)


MEMBERS = {
    "pipeline": lambda plan, chosen: len(plan.stages) > 1,
    "data-parallel": lambda plan, chosen: len(plan.stages) == 1,
    "fewer-stages": lambda plan, chosen: len(plan.stages) < len(chosen.stages),
    "fewer-replicas": lambda plan, chosen: (
        max(c.replicas for c in plan.stages) < max(c.replicas for c in chosen.stages)
    ),
    "more-replicas": lambda plan, chosen: min(c.replicas for c in plan.stages) > min(c.replicas for c in chosen.stages),
    "smaller-tier": lambda plan, chosen: max(c.tier_mb for c in plan.stages) < max(c.tier_mb for c in chosen.stages),
    "larger-tier": lambda plan, chosen: min(c.tier_mb for c in plan.stages) > min(c.tier_mb for c in chosen.stages),
    "micro-batch": lambda plan, chosen: plan.micro_batch != chosen.micro_batch,
}


@pytest.mark.parametrize("seed", range(12))
def test_no_familys_best_beats_a_proven_best_plan(seed: int) -> None:
    """On random problems, for cost and time: every alternative is a plan of its family within the limits,
    evaluated by the cost model, and no better than the chosen plan when that one is proven optimal."""
    problem = random_problem(seed)
    for objective in ("cost", "time"):
        found = baselines(problem, objective)  # type: ignore[arg-type]
        try:
            solution = solve(problem, objective, incumbents=tuple(b.plan for b in found if b.plan))  # type: ignore[arg-type]
        except Infeasible:
            continue
        result = PlanResult(problem.region, problem, solution, found)
        options = PlanOptions(objective=objective, replicas=problem.replicas)  # type: ignore[arg-type]
        for alternative in explain(result, options):
            if alternative.plan is None:
                continue
            assert MEMBERS[alternative.family](alternative.plan, solution.plan), (seed, objective, alternative.family)
            evaluation = check_figures(problem, result, alternative)
            assert evaluation.feasible
            if solution.status == "optimal":
                key, chosen = (
                    objective_key(problem, objective, evaluation),
                    objective_key(problem, objective, solution.evaluation),
                )  # type: ignore[arg-type]
                assert key[0] >= chosen[0] * (1 - 1e-6), (seed, objective, alternative.family)
                assert alternative.summary.startswith("the best, " if alternative.proven else "the best found")


def test_report_plan_json_and_summary_say_why(compile_cli, wide: FrontEnd, tmp_path: Path) -> None:
    """A real build: report.md's "Why this plan" has one line per family, plan.json (schema-checked) the
    explanation's figures, the CLI its one-line summary."""
    build = tmp_path / "build"
    profile = GOLDEN / "wide_mlp_time" / "ir" / "blocks.json"
    code, stdout, stderr = compile_cli(
        str(WIDE),
        "-o",
        str(build),
        "--objective",
        "time",
        "--blocks",
        "8",
        "--target",
        "sam",
        "--profile",
        str(profile),
    )
    assert code == 0, stderr
    result, found = planned(wide, PlanOptions(objective="time", targets=SAM))
    chosen = result.solution.evaluation
    document = load_plan(build / "plan.json")
    assert document.explanation == alternatives_ir(tuple(found.values()), chosen)
    parallel = next(a for a in document.explanation if a.family == "data-parallel")
    assert parallel.time_factor == pytest.approx(found["data-parallel"].evaluation.iteration_s / chosen.iteration_s)  # type: ignore[union-attr]
    report = (build / "report.md").read_text()
    section = report.split("## Why this plan\n", 1)[1].split("\n## ", 1)[0]
    bullets = [line for line in section.splitlines() if line.startswith("- ")]
    assert bullets == [f"- **{a.label}** ({a.description}): {a.summary}." for a in found.values()]
    (line,) = [line for line in stdout.splitlines() if line.startswith("  why ")]
    assert f"data-parallel {fmt(parallel.time_factor, 3)}× (gradient sync)" in line  # type: ignore[arg-type]
    assert line.endswith("; none: more-replicas, larger-tier")
    # A plan without an explanation (several regions, or an older plan.json) has no such section.
    plain = json.loads((build / "plan.json").read_text())
    del plain["explanation"]
    assert "## Why this plan" not in render_markdown(type(document).from_json(plain), Timeline(0.0, ()))


def test_planning_finishes_in_the_plan_pass_and_writing_only_serialises(monkeypatch: pytest.MonkeyPatch) -> None:
    """compile_model's plan pass records the plan (baselines simulated, explanation solved); plan.json
    is that record serialised, and writing the build again with nothing left to solve or simulate gives
    the same bytes."""
    from cloudless.compiler import build
    from cloudless.compiler.pipeline import CompileOptions, compile_model
    from cloudless.compiler.planner import explain, plan_record, simulate

    profile = GOLDEN / "mlp_digits" / "ir" / "blocks.json"
    options = PlanOptions(stages=2)
    compiled = compile_model(CompileOptions(FrontEndOptions(DIGITS, profile_from=profile), plan=options))
    assert compiled.record is not None and compiled.record.explanation
    assert json.loads(compiled.files["plan.json"]) == compiled.record.to_json()

    def no_planning(*args: object, **kwargs: object) -> None:
        raise AssertionError("the write step planned")

    planners = ((explain, "solve"), (plan_record, "simulate"), (simulate, "simulate"), (plan_record, "explain"))
    for module, name in planners:
        monkeypatch.setattr(module, name, no_planning)
    again = build.build_files(
        compiled.front.graph,
        compiled.front.chain,
        compiled.record,
        options,
        compiled.timeline,
        compiled.lowered,
    )
    assert again == compiled.files
