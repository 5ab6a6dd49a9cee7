"""The build's report: report.md's content, the two SVGs, and that the same inputs give the same bytes."""

from __future__ import annotations

import dataclasses
import random
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import yaml

from cloudless.codegen.report import (
    COMPARISON_SVG,
    REPORT_MD,
    SCHEDULE_SVG,
    render_report,
    stage_rows,
)
from cloudless.codegen.report_figures import (
    group_of,
    replicas_shown,
    schedule_bars,
    schedule_rows,
    svg_summary,
)
from cloudless.compiler.planner.baselines import baselines
from cloudless.compiler.planner.cost_model import BlockCost, CostModel, Plan, Problem, StageChoice
from cloudless.compiler.planner.pipeline_program import Solution
from cloudless.compiler.planner.plan import PlanOptions, PlanResult
from cloudless.compiler.planner.plan_record import plan_ir
from cloudless.compiler.planner.simulate import simulate
from cloudless.ir import Block, BlockChain
from cloudless.ir.files import plan_text
from cloudless.ir.plan import BaselinePlan, Totals, TrainingPlan
from cloudless.ir.timeline import Timeline
from cloudless.ir.workflow import (
    DataSpec,
    Function,
    OptimizerSpec,
    Region,
    RunSettings,
    StorageSpec,
    SyncSettings,
    Workflow,
)

from .conftest import ROOT, SAMPLES
from .planning_cases import random_problem

SVG = "{http://www.w3.org/2000/svg}"
GOLDEN_SVGS = sorted((ROOT / "tests" / "golden").glob("*/report/*.svg"))


def make_case(
    seed: int,
    stages: int,
    replicas: int,
    micro_batches: int,
    schedule: str = "gpipe",
) -> tuple[TrainingPlan, Timeline]:
    """A schema-valid plan with real baselines, for `stages` equal stages of `replicas`
    replicas each, and the plan's simulated timeline."""
    rng = random.Random(seed)
    base = random_problem(seed)
    n_blocks = stages + 1
    blocks = []
    previous = rng.randint(10**4, 10**6)
    for _ in range(n_blocks):
        out = rng.randint(10**4, 10**6)
        blocks.append(
            BlockCost(
                forward_s=rng.uniform(0.01, 0.2),
                backward_s=rng.uniform(0.02, 0.4),
                param_bytes=rng.randint(10**5, 10**7),
                buffer_bytes=0,
                saved_bytes=rng.randint(10**5, 10**7),
                input_bytes=previous,
                output_bytes=out,
            )
        )
        previous = out
    problem: Problem = dataclasses.replace(
        base,
        blocks=tuple(blocks),
        shared_bytes={},
        profile_batch=1,
        global_batch=micro_batches,
        micro_batches=(1,),
        replicas=(1, replicas),
        max_stages=stages,
        max_functions=None,
        schedule=schedule,
    )
    cuts = [round(i * n_blocks / stages) for i in range(stages + 1)]
    tier = max(problem.region.tiers_mb)
    plan = Plan(1, tuple(StageChoice(a, b - 1, tier, replicas) for a, b in zip(cuts, cuts[1:], strict=False)))
    evaluation = CostModel(problem).evaluate(plan)
    solution = Solution(plan, evaluation, evaluation.cost_usd, "optimal", 0.0, 0.25, "HiGHS")
    chain = BlockChain(
        model="toy-mlp",
        batch_size=1,
        blocks=[
            Block(
                index=i,
                first=i,
                last=i,
                nodes=[],
                # Some blocks hold many modules, to exercise the shortened module list.
                modules=[f"layers.{i}.{k}" for k in range(1 + 3 * (i % 2))],
                flops=0,
                param_bytes=b.param_bytes,
                buffer_bytes=0,
                saved_bytes=b.saved_bytes,
                input_bytes=b.input_bytes,
                output_bytes=b.output_bytes,
            )
            for i, b in enumerate(blocks)
        ],
        shared_params={},
    )
    result = PlanResult(problem.region, problem, solution, baselines(problem, "cost"))
    timeline = simulate(problem, plan)
    document = plan_ir(result, chain, PlanOptions(objective="cost", schedule=schedule), timeline)
    plan_text(document)  # checked against its schema
    return document, timeline


def with_infeasible_baseline(document: TrainingPlan) -> TrainingPlan:
    reason = "its largest stage needs 123456 MB even on the 10240 MB tier with 8 replicas at micro-batch 1"
    extra = BaselinePlan(
        name="too-big",
        description="a baseline that cannot fit",
        feasible=False,
        reason=reason,
        micro_batch=None,
        stages=(),
        predicted=None,
        time_ratio=None,
        cost_ratio=None,
    )
    document = dataclasses.replace(document, baselines=(*document.baselines, extra))
    plan_text(document)
    return document


def workflow_for(document: TrainingPlan) -> Workflow:
    """A workflow of one region for the plan; the report reads its regions' functions."""
    functions = tuple(
        Function(
            name=f"toy-s{s.index}",
            stage=s.index,
            blocks=s.blocks,
            memory_mb=s.tier_mb,
            cpu_millis=1000,
            network_mb_per_s=100.0,
            replicas=s.replicas,
            timeout_s=900,
            package=f"regions/{document.region}/functions/toy-s{s.index}",
            inputs=(),
            outputs=(),
            shared_parameters=(),
        )
        for s in document.stages
    )
    return Workflow(
        model=document.model,
        run=RunSettings(
            name="toy",
            iterations=1,
            global_batch=document.global_batch,
            micro_batch=document.micro_batch,
            micro_batches=document.micro_batches,
            schedule=document.schedule,
            checkpoint_every=1,
            seed=0,
        ),
        optimizer=OptimizerSpec("SGD", {"lr": 0.1}),
        sync=SyncSettings("pipelined-scatter-reduce", 1 << 20, 16),
        storage=StorageSpec("toy-bucket", "toy/"),
        data=DataSpec("toy.py", ("x",), 1, "loss"),
        regions=(Region(document.region, "aws", None, 0.02, functions),),
        steps=(),
    )


@pytest.fixture(scope="module")
def small() -> tuple[TrainingPlan, Timeline]:
    document, timeline = make_case(3, stages=3, replicas=2, micro_batches=8)
    return with_infeasible_baseline(document), timeline


def drawn_groups(svg: bytes) -> dict[str, int]:
    """Rectangles per span group: each group (gid spans-<group>) is one path with a subpath per bar."""
    root = ET.fromstring(svg)
    return {
        g.get("id"): sum(p.get("d").count("M") for p in g.iter(f"{SVG}path"))
        for g in root.iter(f"{SVG}g")
        if (g.get("id") or "").startswith("spans-")
    }


def texts(svg: bytes) -> list[str]:
    return ["".join(t.itertext()) for t in ET.fromstring(svg).iter(f"{SVG}text")]


def test_report_has_three_files_and_is_byte_identical(small) -> None:
    document, timeline = small
    files = render_report(document, timeline, workflow_for(document))
    assert set(files) == {REPORT_MD, SCHEDULE_SVG, COMPARISON_SVG}
    again = render_report(document, timeline, workflow_for(document))
    assert files == again
    for name in (SCHEDULE_SVG, COMPARISON_SVG):
        svg = files[name].decode()
        assert "<dc:date>" not in svg and "Matplotlib v" not in svg


def test_markdown_lists_stages_figures_baselines_and_deployment(small) -> None:
    document, timeline = small
    text = render_report(document, timeline, workflow_for(document))[REPORT_MD].decode()
    assert text.startswith("# Training plan for toy-mlp")
    for row in stage_rows(document.stages):
        assert "| " + " | ".join(row) + " |" in text
    assert "(4 modules)" in text  # a long module list is shortened
    for baseline in document.baselines:
        assert f"**{baseline.name}**" in text
    assert "no: its largest stage needs 123456 MB" in text
    assert "![" in text and "](report/comparison.svg)" in text and "](report/schedule.svg)" in text
    assert "`toy-s2`" in text
    assert "faas-cli" not in text and "sam build" not in text  # no deployment files given: no steps
    assert "## Deployment" not in render_report(document, timeline)[REPORT_MD].decode()
    assert "Per epoch" not in text
    epoch = Totals(iterations=12, time_s=34.5, cost_usd=0.0123)
    with_epoch = dataclasses.replace(document, predicted=dataclasses.replace(document.predicted, per_epoch=epoch))
    assert (
        "- Per epoch (12 iterations): 34.50 s, 0.01230 USD" in render_report(with_epoch, timeline)[REPORT_MD].decode()
    )


def test_baselines_without_a_ratio_read_n_a(small) -> None:
    """A feasible baseline whose figure is zero (a free catalog) has no ratio: plan.json's null is n/a in the
    table, with one sentence saying why; the comparison picture draws the zero bars."""
    document, timeline = small
    text = render_report(document, timeline)[REPORT_MD].decode()
    assert "n/a" not in text
    free = tuple(
        dataclasses.replace(
            b,
            cost_ratio=None,
            predicted=dataclasses.replace(b.predicted, cost_usd=0.0) if b.predicted is not None else None,
        )
        for b in document.baselines
    )
    changed = dataclasses.replace(
        document, baselines=free, predicted=dataclasses.replace(document.predicted, cost_usd=0.0)
    )
    plan_text(changed)  # still a valid plan.json
    files = render_report(changed, timeline)
    text = files[REPORT_MD].decode()
    feasible = [b for b in changed.baselines if b.feasible]
    for baseline in feasible:
        row = next(line for line in text.splitlines() if line.startswith(f"| **{baseline.name}**"))
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        assert cells[-1] == "n/a" and cells[-2].endswith("×") and cells[4] == "0", row
    assert "n/a: the baseline's figure is 0" in text
    assert not re.search(r"\b(inf|nan)\b", text, re.IGNORECASE)
    assert svg_summary(files[COMPARISON_SVG])


def test_schedule_draws_every_span_and_a_legend(small) -> None:
    document, timeline = small
    svg = render_report(document, timeline)[SCHEDULE_SVG]
    bars = schedule_bars(document, timeline)
    groups = drawn_groups(svg)
    assert sum(groups.values()) == len(bars)
    # Every replica is shown here, and every span lies in a bar of its row and group (touching spans
    # merge only when too thin to tell apart, or when they are pieces of one gradient sync).
    rows = schedule_rows(document)
    assert len(rows) == 3 * sum(s.replicas for s in document.stages)
    for span in timeline.spans:
        row = rows.index((span.stage, span.replica, span.lane))
        assert any(
            b.row == row and b.group == group_of(span.kind) and b.start <= span.start and span.end <= b.end
            for b in bars
        ), span
    wide = [s for s in timeline.spans if s.kind in ("forward", "backward")]
    assert len([b for b in bars if b.group in ("forward", "backward")]) == len(wide)
    labels = set(texts(svg))
    for label in ("forward", "backward", "activation transfer", "gradient transfer", "optimizer update"):
        assert label in labels
        assert f"spans-{label.replace(' ', '-')}" in groups
    assert "sync scatter-reduce" in labels  # two replicas per stage sync their gradients


def test_comparison_shows_plan_and_feasible_baselines(small) -> None:
    document, timeline = small
    svg = render_report(document, timeline)[COMPARISON_SVG]
    feasible = [b.name for b in document.baselines if b.feasible]
    root = ET.fromstring(svg)
    ids = [g.get("id") or "" for g in root.iter(f"{SVG}g")]
    for unit in ("s", "usd"):
        assert len([i for i in ids if i.startswith(f"bar-{unit}-")]) == 1 + len(feasible)
    labels = " ".join(texts(svg))
    assert "this plan" in labels and all(name in labels for name in feasible)
    assert "too-big" in labels  # named as not shown


@pytest.mark.slow
def test_large_plan_caps_rows_and_stays_small() -> None:
    document, timeline = make_case(5, stages=16, replicas=8, micro_batches=64, schedule="1f1b")
    files = render_report(document, timeline)
    cap = replicas_shown(document)
    assert cap < 8
    assert len(schedule_rows(document)) == 16 * cap * 3
    svg = files[SCHEDULE_SVG]
    assert len(svg) < 300_000, len(svg)
    assert f"first {cap} replicas of each stage shown" in " ".join(texts(svg))
    assert sum(drawn_groups(svg).values()) == len(schedule_bars(document, timeline))


def test_report_imports_no_compiler_or_runtime() -> None:
    """codegen draws the ir's objects: importing the report loads no compiler or runtime module."""
    code = "import sys, cloudless.codegen.report; print(' '.join(sorted(sys.modules)))"
    loaded = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.split()
    assert [m for m in loaded if m.startswith(("cloudless.compiler", "cloudless.runtimes"))] == []


def as_another_release_might_draw_it(svg: bytes) -> bytes:
    """The picture with what a matplotlib release may change without changing what it shows: other
    ids and clip paths, other x ticks and offset, texts moved, numbers printed to more digits,
    no metadata, another style sheet, and the file serialised anew."""
    ET.register_namespace("", SVG[1:-1])
    root = ET.fromstring(svg)
    for parent in root.iter():
        for child in list(parent):
            if child.tag in (f"{SVG}metadata", f"{SVG}style"):
                parent.remove(child)
    for element in root.iter():
        for key, value in element.attrib.items():
            value = re.sub(r"\b([mp])([0-9a-f]{10})\b", lambda m: m.group(1) + m.group(2)[::-1], value)
            if key == "d":
                value = re.sub(r"\d+\.\d+", lambda m: f"{float(m.group()) + 1e-5:.7f}", value)
            if element.tag == f"{SVG}text" and key in ("x", "y"):
                value = str(float(value) + 0.7)
            element.set(key, value)
        if (element.get("id") or "").startswith("xtick_"):
            for text in element.iter(f"{SVG}text"):
                text.text = "2.5"
        if (element.get("id") or "").startswith("matplotlib.axis"):
            for child in element:
                if child.get("id", "").startswith("text_") and re.fullmatch(r"[0-9e−.]+", "".join(child.itertext())):
                    next(child.iter(f"{SVG}text")).text = "1e−7"
    return ET.tostring(root)


@pytest.mark.parametrize("path", GOLDEN_SVGS, ids=lambda p: f"{p.parent.parent.name}/{p.name}")
def test_svg_summary_ignores_what_a_release_may_change(path) -> None:
    svg = path.read_bytes()
    summary = svg_summary(svg)
    assert summary == svg_summary(as_another_release_might_draw_it(svg))
    assert "\ntext " in summary and "\nshape " in summary
    # ...but not what the picture shows: a colour, a bar's place, a label.
    first_bar = re.compile(rb'(<g id="(?:bar|spans)-[^"]*">\s*<path d="M )(\d+)')
    assert first_bar.search(svg)
    moved = first_bar.sub(lambda m: m.group(1) + str(int(m.group(2)) + 1).encode(), svg, count=1)
    assert svg_summary(moved) != summary
    assert svg_summary(svg.replace(b"fill: #3b6fb6", b"fill: #3b6fb7", 1)) != summary
    label = b"this plan<" if path.name == "comparison.svg" else b"forward<"
    assert svg_summary(svg.replace(label, b"x" + label, 1)) != summary


def test_svg_summary_lists_every_bar_and_label(small) -> None:
    document, timeline = small
    files = render_report(document, timeline)
    schedule = svg_summary(files[SCHEDULE_SVG]).splitlines()
    assert schedule[0].startswith("size 792pt x ")
    shapes = {line.split(" fill ")[0].removeprefix("shape "): line for line in schedule if line.startswith("shape ")}
    for group, bars in drawn_groups(files[SCHEDULE_SVG]).items():
        assert shapes[group].split(": ", 1)[1].split().count("M") == bars
    shown = [line.removeprefix("text ") for line in schedule if line.startswith("text ")]
    assert set(shown) <= set(texts(files[SCHEDULE_SVG]))
    labels = [f"s{s} r{j}  compute" for s, j, lane in schedule_rows(document) if lane == "compute"]
    for label in [*labels, "forward", "optimizer update", "seconds since the iteration started"]:
        assert label in shown
    assert any(t.startswith("toy-mlp: simulated iteration") for t in shown)
    comparison = svg_summary(files[COMPARISON_SVG])
    for i in range(1 + len([b for b in document.baselines if b.feasible])):
        assert f"shape bar-s-{i} fill #" in comparison and f"shape bar-usd-{i} fill #" in comparison


@pytest.mark.parametrize("registry", [None, "ghcr.io/acme"])
def test_the_deploy_steps_are_each_targets_from_where_it_runs(
    registry: str | None, compile_cli, tmp_path: Path
) -> None:
    """OpenFaaS from the region's folder (template pull, both secrets, up), SAM from the build folder,
    then cloudless-run for each; a stack without registry says so in the steps and under Warnings."""
    out = tmp_path / "b"
    code, _, stderr = compile_cli(
        str(SAMPLES / "mlp_digits.py"), "-o", str(out), "--repeats", "1", "-q",
        *(["--registry", registry] if registry else []),
    )  # fmt: skip
    assert code == 0, stderr
    text = (out / "report.md").read_text()
    region = "aws-us-east-1"
    steps = [
        "faas-cli secret create cloudless-storage --from-file ~/storage.env",
        "openssl rand -hex 32 > ~/mlp-digits.token && faas-cli secret create cloudless-token --from-file "
        "~/mlp-digits.token",
        f"(cd regions/{region} && faas-cli template pull stack -f stack.yaml && faas-cli up -f stack.yaml)",
        "cloudless-run . --invoker openfaas --gateway http://127.0.0.1:8080 --token-file ~/mlp-digits.token",
        f"sam build --config-env {region} && sam deploy --config-env {region}",
        f"cloudless-run . --invoker lambda --stack mlp-digits-{region} --out trained",
    ]
    positions = [text.index(step) for step in steps]
    assert positions == sorted(positions)
    stack = yaml.safe_load((out / "regions" / region / "stack.yaml").read_text())
    assert stack["provider"]["gateway"] == "http://127.0.0.1:8080"
    warned = "the images have no registry" in text.split("## Warnings")[1].split("##")[0]
    assert warned == (registry is None) == ("recompile with --registry" in text)
    if registry is None:
        assert "regions/aws-us-east-1/stack.yaml: the images have no registry" in stderr  # what the compile said
