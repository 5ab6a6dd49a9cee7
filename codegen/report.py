"""The build's report for people: report.md with the plan, its figures and the baselines, and two pictures.

`render_report` returns relative path -> bytes. The pictures are SVG drawn with matplotlib (no pyplot
state) under fixed settings so that the same plan and timeline always give the same bytes: a fixed
hash salt for the SVG ids, no date or creator metadata, text kept as text in one font, and numbers
formatted to a fixed number of significant digits. What a later matplotlib release may still change
(ids, tick choices, text placement, number printing) `svg_summary` leaves out: golden tests compare
pictures through it.

It draws the ir's objects (the plan, the simulated timeline, the workflow) and imports nothing of the
compiler.
"""

from __future__ import annotations

import io
import math
import re
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import matplotlib
import matplotlib.style
import yaml
from matplotlib.figure import Figure
from matplotlib.patches import Patch, PathPatch
from matplotlib.path import Path

from cloudless.codegen.checks.openfaas import stack_warnings
from cloudless.codegen.platforms import region_bucket, stack_name
from cloudless.ir.plan import Figures, PlannedStage, RegionSchedule, TrainingPlan
from cloudless.ir.protocol import PEERS_ENV, STORAGE_ENV, STORAGE_SECRET, TOKEN_SECRET
from cloudless.ir.timeline import LANES, Span, Timeline
from cloudless.ir.workflow import Workflow

REPORT_MD = "report.md"
SCHEDULE_SVG = "report/schedule.svg"
COMPARISON_SVG = "report/comparison.svg"

#: at most this many replicas of a stage get rows in the schedule...
MAX_REPLICAS_SHOWN = 8
#: ...and fewer when there are many stages, so the chart keeps about this many functions (3 rows each)
MAX_FUNCTIONS_SHOWN = 32
#: modules listed in full in the stage table; longer lists become "first .. last (n modules)"
MAX_MODULES_LISTED = 3

# Span kind -> legend group; kinds not listed fall into a grey group named after the kind.
_GROUPS = {
    "forward": "forward",
    "backward": "backward",
    "recv-activation": "activation transfer",
    "send-activation": "activation transfer",
    "recv-gradient": "gradient transfer",
    "send-gradient": "gradient transfer",
    "sync-scatter": "sync scatter-reduce",
    "sync-gather": "sync gather",
    "update": "optimizer update",
}
_COLOURS = {
    "forward": "#3b6fb6",
    "backward": "#e8833a",
    "activation transfer": "#a6c8ea",
    "gradient transfer": "#f6c08f",
    "sync scatter-reduce": "#7dc98f",
    "sync gather": "#2f8f4e",
    "optimizer update": "#b4477a",
}
_OTHER_COLOUR = "#9a9a9a"
_PLAN_COLOUR = "#3b6fb6"
_BASELINE_COLOUR = "#b8b8b8"

# Fixed rendering settings (see the module docstring); applied over matplotlib's defaults so that a
# user's matplotlibrc cannot change the bytes.
_RC = {
    "svg.hashsalt": "cloudless-report",
    "svg.fonttype": "none",
    "font.family": "DejaVu Sans",
    "font.size": 8,
    "axes.titlesize": 9,
    "axes.labelsize": 8,
    "xtick.labelsize": 7,
    "ytick.labelsize": 7,
    "legend.fontsize": 7,
    "figure.dpi": 72,
    "savefig.dpi": 72,
}
# Only these SVG metadata keys would vary between runs or versions; None leaves them out.
_SVG_METADATA = {"Date": None, "Creator": None}

# Schedule layout, in inches (72 points each).
_GANTT_WIDTH = 11.0
_GANTT_LEFT, _GANTT_RIGHT, _GANTT_TOP, _GANTT_BOTTOM = 1.3, 0.25, 0.55, 0.75
_ROW_HEIGHT = 0.16
_BAR_HEIGHT = 0.8  # of a row
_LABEL_FONT = 5.5  # points, micro-batch numbers inside compute spans
_MERGE_GAP_PT = 0.5  # spans closer than this on one row touch on the picture
_MIN_SPLIT_PT = 2.0  # narrower touching spans of one group are drawn as one bar
_SEPARATOR_PT = 0.4  # blank at the end of each bar, so touching bars stay apart
_RECT_CODES = [Path.MOVETO, Path.LINETO, Path.LINETO, Path.LINETO, Path.CLOSEPOLY]


# --- numbers ---------------------------------------------------------------------------------------


def fmt(value: float | None, digits: int = 4) -> str:
    """`digits` significant digits in plain decimal notation (never exponent), for stable text."""
    if value is None or not math.isfinite(value):
        return "-"
    if value == 0:
        return "0"
    decimals = max(0, min(10, digits - 1 - math.floor(math.log10(abs(value)))))
    return f"{value:.{decimals}f}"


def fmt_s(value: float) -> str:
    return f"{fmt(value)} s"


def fmt_usd(value: float) -> str:
    return f"{fmt(value)} USD"


def fmt_ratio(value: float | None) -> str:
    """A ratio of plan.json; null (a baseline's figure is zero, so no ratio exists) is `n/a`."""
    return "n/a" if value is None or not math.isfinite(value) else f"{fmt(value, 3)}×"


# --- entry point -----------------------------------------------------------------------------------


def render_report(
    plan: TrainingPlan,
    timeline: Timeline,
    workflow: Workflow | None = None,
    deployment: Mapping[str, bytes] | None = None,
) -> dict[str, bytes]:
    """report.md and its two pictures for `plan` (plan.json) and its simulated `timeline`; with
    `workflow` (workflow.yaml) also the functions per region and, from the build's `deployment` files
    (stacks, templates), how to deploy them and what their platforms would refuse."""
    return {
        REPORT_MD: render_markdown(plan, timeline, workflow, deployment or {}).encode(),
        COMPARISON_SVG: svg_bytes(comparison_figure, plan),
        SCHEDULE_SVG: svg_bytes(schedule_figure, plan, timeline),
    }


@contextmanager
def fixed_style() -> Iterator[None]:
    """matplotlib's defaults plus _RC, for building and saving a figure (fonts are read at both)."""
    with ExitStack() as stack:
        stack.enter_context(matplotlib.style.context("default"))
        stack.enter_context(matplotlib.rc_context(_RC))  # type: ignore[arg-type]  # stubs want literal keys
        yield


def svg_bytes(build: Callable[..., Figure], *args: Any) -> bytes:
    """The SVG of the figure `build(*args)` returns, drawn under the fixed style."""
    with fixed_style():
        figure: Figure = build(*args)
        buffer = io.BytesIO()
        figure.savefig(buffer, format="svg", metadata=_SVG_METADATA)
    return buffer.getvalue()


# --- what a picture shows, for comparisons --------------------------------------------------------

_SVG_NS = "{http://www.w3.org/2000/svg}"
#: ids the report gives its own shapes (bars of the comparison, span groups of the schedule)
_OWN_SHAPES = ("bar-", "spans-")
_NUMBER = re.compile(r"-?\d+(?:\.\d*)?(?:e-?\d+)?")
#: an axis's offset text ("1e−6", "+1.5", "×10^{−6}"), which matplotlib's tick formatter chooses
_AXIS_OFFSET = re.compile(r"[-−+×.\de^{}$\\ ]+")


def svg_summary(svg: bytes, digits: int = 1) -> str:
    """What a report picture shows, one line per item, free of what a matplotlib release may change
    without changing the picture: the figure's size; every text in drawing order (titles, axis and
    legend labels, stage and lane names, figures and micro-batch numbers), except the x axis's tick
    labels and offset, which matplotlib's locator and formatter choose; and the report's own shapes (ids `bar-*`,
    `spans-*`) with their fill colour and outline, in points rounded to `digits` decimals. Ids,
    clip paths, marker definitions, metadata, styles of matplotlib's own elements and the positions
    of texts are left out. Golden tests compare this instead of the bytes."""
    root = ET.fromstring(svg)
    lines = [f"size {root.get('width')} x {root.get('height')}"]

    def visit(element: ET.Element, shape: str | None, x_axis: bool) -> None:
        gid = element.get("id") or ""
        if element.tag == f"{_SVG_NS}g" and gid.startswith("xtick_"):
            return  # matplotlib's own x ticks: their number, place and text follow its locator
        # An axis of matplotlib's whose ticks are x ticks.
        x_axis = x_axis or any((child.get("id") or "").startswith("xtick_") for child in element)
        if gid.startswith(_OWN_SHAPES):
            shape = gid
        if element.tag == f"{_SVG_NS}text":
            text = "".join(element.itertext())
            if not (x_axis and _AXIS_OFFSET.fullmatch(text)):
                lines.append("text " + text)
            return
        if element.tag == f"{_SVG_NS}path" and shape is not None:
            fill = re.search(r"fill:\s*([^;]+)", element.get("style") or "")
            outline = " ".join(
                f"{float(token):.{digits}f}" if _NUMBER.fullmatch(token) else token
                for token in re.findall(r"[A-Za-z]|" + _NUMBER.pattern, element.get("d") or "")
            )
            lines.append(f"shape {shape} fill {fill.group(1).strip() if fill else '-'}: {outline}")
        for child in element:
            visit(child, shape, x_axis)

    visit(root, None, False)
    return "\n".join(lines) + "\n"


# --- report.md -------------------------------------------------------------------------------------


def _cell(text: Any) -> str:
    """A Markdown table cell: pipes escaped, line breaks flattened."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]], align: str) -> list[str]:
    """`align` has one letter per column: l (left) or r (right)."""
    rule = ["---:" if a == "r" else "---" for a in align]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(rule) + " |"]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return lines


def _blocks(blocks: Sequence[int]) -> str:
    first, last = blocks
    return str(first) if first == last else f"{first}–{last}"


def _modules(modules: Sequence[str]) -> str:
    if not modules:
        return "-"
    if len(modules) <= MAX_MODULES_LISTED:
        return ", ".join(f"`{m}`" for m in modules)
    return f"`{modules[0]}` .. `{modules[-1]}` ({len(modules)} modules)"


def stage_rows(stages: Sequence[PlannedStage]) -> list[list[str]]:
    """The stage table's rows (also used by tests to find them in report.md)."""
    return [
        [
            str(s.index),
            _blocks(s.blocks),
            _modules(s.modules),
            str(s.tier_mb),
            str(s.replicas),
            fmt(s.memory_mb),
            f"{fmt(s.forward_s)} + {fmt(s.backward_s)}",
        ]
        for s in stages
    ]


def render_markdown(
    plan: TrainingPlan,
    timeline: Timeline,
    workflow: Workflow | None = None,
    deployment: Mapping[str, bytes] | None = None,
) -> str:
    predicted = plan.predicted
    lines = [
        f"# Training plan for {plan.model}",
        "",
        f"Region **{plan.region}**, objective **{plan.objective}**, schedule **{plan.schedule}**, "
        f"micro-batch **{plan.micro_batch} × {plan.micro_batches}** (global batch {plan.global_batch}).",
    ]
    limits = []
    if plan.deadline_s is not None:
        limits.append(f"deadline {fmt_s(plan.deadline_s)} per run")
    if plan.budget_usd is not None:
        limits.append(f"budget {fmt_usd(plan.budget_usd)} per run")
    if limits:
        lines += ["", "Limits: " + ", ".join(limits) + "."]

    lines += ["", "## Plan", ""]
    lines += _table(
        [
            "Stage",
            "Blocks",
            "Modules",
            "Memory tier (MB)",
            "Replicas",
            "Memory used (MB)",
            "Forward + backward per micro-batch (s)",
        ],
        stage_rows(plan.stages),
        "lllrrrr",
    )

    solver = plan.solver
    gap = "unknown" if solver.gap is None else f"{fmt(100 * solver.gap, 3)} %"
    run = predicted.per_run
    lines += [
        "",
        "## Predicted figures",
        "",
        f"- Iteration time (cost model): **{fmt_s(predicted.iteration_s)}** = pipeline "
        f"{fmt_s(predicted.pipeline_s)} + gradient sync {fmt_s(predicted.sync_s)} + optimizer update "
        f"{fmt_s(predicted.update_s)}",
        f"- Iteration time (simulated, drawn below): **{fmt_s(timeline.iteration_s)}**",
        f"- Cost per iteration: **{fmt_usd(predicted.cost_usd)}** = compute {fmt_usd(predicted.compute_usd)} "
        f"+ requests {fmt_usd(predicted.request_usd)} + storage {fmt_usd(predicted.storage_usd)}",
        f"- Per run ({run.iterations} iterations): {fmt_s(run.time_s)}, {fmt_usd(run.cost_usd)}",
    ]
    epoch = predicted.per_epoch
    if epoch is not None:
        lines.append(f"- Per epoch ({epoch.iterations} iterations): {fmt_s(epoch.time_s)}, {fmt_usd(epoch.cost_usd)}")
    lines.append(
        f"- Solver: {solver.name}, status **{solver.status}**, gap {gap} "
        f"(time limit {fmt_s(solver.time_limit_s)} per micro-batch size)"
    )

    lines += ["", "## Warnings", ""]
    stacks = {path: data.decode() for path, data in (deployment or {}).items() if path.endswith("/stack.yaml")}
    warnings = [*predicted.warnings, *stack_warnings(stacks)]  # what the compile also warns of
    lines += [f"- {w}" for w in warnings] or ["None."]

    lines += ["", "## Baselines", ""]
    if plan.baselines:
        explained = "Ratios are this plan's figure over the baseline's: below 1× means this plan is better."
        if any(b.feasible and None in (b.time_ratio, b.cost_ratio) for b in plan.baselines):
            explained += " n/a: the baseline's figure is 0 (the catalog's prices or times), so there is no ratio."
        lines.append(explained)
        lines.append("")
        rows = [
            _baseline_row(
                b.name,
                b.description,
                b.reason,
                None if b.predicted is None or not b.feasible else (b.predicted.iteration_s, b.predicted.cost_usd),
                (b.time_ratio, b.cost_ratio),
            )
            for b in plan.baselines
        ]
        lines += _table(
            ["Baseline", "Description", "Feasible", "Time (s)", "Cost (USD)", "Time ratio", "Cost ratio"],
            rows,
            "lllrrrr",
        )
    else:
        lines.append("None were computed.")

    if plan.regions is not None:
        lines += region_lines(plan.regions)

    if plan.explanation is not None:
        lines += ["", "## Why this plan", ""]
        lines += why_lines(plan)

    lines += [
        "",
        "## Pictures",
        "",
        "![Time and cost per iteration of this plan and of each feasible baseline](report/comparison.svg)",
        "",
        "Each panel has one bar per plan (this plan highlighted in blue, baselines in grey); shorter is better, "
        "and the figure at the end of each bar is the predicted value.",
        "",
        "![Simulated schedule of one training iteration](report/schedule.svg)",
        "",
        "Each row is one lane (compute, download or upload) of one function, `s2 r1` being replica 1 of stage 2; "
        "time runs left to right, and the numbers in the forward and backward spans are the micro-batches.",
    ]
    if workflow is not None:
        lines += _deployment(workflow, deployment or {})
    return "\n".join(lines) + "\n"


SYNC_TEXT = {
    "sync": "synchronous cross-region SGD (every iteration's gradients meet across regions)",
    "asgd-ga": "ASGD-GA (each region adds its round's accumulated update to the global model in the server region)",
    "model-average": "model averaging (the regions' models meet at a barrier every round)",
}


def region_lines(schedule: RegionSchedule) -> list[str]:
    """The "Between regions" section: who trains on what for how many iterations, what data moves where,
    how the regions meet, a picture (a Mermaid flowchart, text: byte-identical across compiles) and the
    naive placements against the schedule."""
    server = f", server **{schedule.server}**" if schedule.server else ""
    lines = [
        "",
        "## Between regions",
        "",
        f"Sync: **{schedule.sync}**, {SYNC_TEXT[schedule.sync]}; {schedule.rounds} rounds{server}. "
        f"Predicted training: **{fmt_s(schedule.training_s)}**, **{fmt_usd(schedule.cost_usd)}** "
        f"(solver status {schedule.solver.status}).",
        "",
    ]
    rows = []
    for site in schedule.sites:
        rows.append(
            [
                f"**{site.name}**",
                str(site.data_samples),
                "yes" if site.trains else "no",
                f"{site.samples:.0f}" if site.trains else "-",
                str(site.runs_iterations) if site.runs_iterations is not None else "-",
                fmt(site.move_in_s) if site.trains else "-",
                fmt(site.work_s) if site.trains else "-",
                fmt(site.sync_s) if site.trains else "-",
                fmt(site.cost_usd) if site.trains else "-",
            ]
        )
    lines += _table(
        [
            "Region",
            "Data held",
            "Trains",
            "Trains on",
            "Iterations",
            "Move-in (s)",
            "Work (s)",
            "Sync (s)",
            "Cost (USD)",
        ],
        rows,
        "lrlrrrrrr",
    )
    lines += ["", "Data moves before training (one way per pair of regions):", ""]
    lines += [f"- {m.from_region} → {m.to_region}: {m.samples:.0f} samples" for m in schedule.moves] or ["- none"]
    lines += ["", "```mermaid", *region_picture(schedule), "```", ""]
    lines += [
        "Regions that train are boxes with their samples and iterations; solid arrows move data (samples), dotted "
        "ones are the sync between regions.",
        "",
        "Naive placements on the same cost model (ratios: this schedule over the placement; below 1× is better):",
        "",
    ]
    baseline_rows = [
        _baseline_row(
            b.name,
            b.description,
            b.reason,
            (b.training_s, b.cost_usd) if b.feasible and b.training_s is not None and b.cost_usd is not None else None,
            (b.time_ratio, b.cost_ratio),
        )
        for b in schedule.baselines
    ]
    lines += _table(
        ["Placement", "Description", "Feasible", "Training (s)", "Cost (USD)", "Time ratio", "Cost ratio"],
        baseline_rows,
        "lllrrrr",
    )
    return lines


def region_picture(schedule: RegionSchedule) -> list[str]:
    """A Mermaid flowchart of the regions, the data moves and the sync (deterministic text)."""
    ids = {site.name: f"r{i}" for i, site in enumerate(schedule.sites)}
    lines = ["flowchart LR"]
    for site in schedule.sites:
        if site.trains:
            label = f"{site.name}<br/>{site.samples:.0f} samples, {site.runs_iterations} iterations"
            if site.name == schedule.server:
                label += "<br/>ASGD-GA server"
            lines.append(f'  {ids[site.name]}["{label}"]')
        else:
            lines.append(f'  {ids[site.name]}("{site.name}<br/>does not train")')
    for move in schedule.moves:
        lines.append(f"  {ids[move.from_region]} -->|{move.samples:.0f} samples| {ids[move.to_region]}")
    training = [site.name for site in schedule.sites if site.trains]
    if schedule.sync == "asgd-ga" and schedule.server is not None:
        for name in training:
            if name != schedule.server:
                lines.append(f"  {ids[name]} -.->|push, pull| {ids[schedule.server]}")
    else:
        label = "gradients every iteration" if schedule.sync == "sync" else "models every round"
        for i, a in enumerate(training):
            for b in training[i + 1 :]:
                lines.append(f"  {ids[a]} <-.->|{label}| {ids[b]}")
    return lines


def why_lines(plan: TrainingPlan) -> list[str]:
    """The "Why this plan" section: one bullet per family of plans the chosen plan is not in (plan.json's
    `explanation`, compiler/explain.py), with its best plan and the term it loses most by."""
    measure = "time" if plan.objective in ("time", "time-under-budget") else "cost"
    lines = [
        "For each family of plans this one is not in: the family's best plan for the objective within the limits "
        f"(found by the planner, on the same cost model), and the term of the iteration's {measure} it loses most "
        "by. `plan.json`'s `explanation` lists every term.",
        "",
    ]
    bullets = [f"- **{a.label}** ({a.description}): {a.summary}." for a in plan.explanation or ()]
    return lines + (bullets or ["None: no other family of plans was possible."])


def _baseline_row(
    name: str,
    description: str,
    reason: str,
    figures: tuple[float, float] | None,
    ratios: tuple[float | None, float | None],
) -> list[str]:
    """A baseline's row: its time and cost and this plan's ratios to them, or why it is infeasible."""
    if figures is None:
        return [f"**{name}**", description, f"no: {reason}", "-", "-", "-", "-"]
    return [f"**{name}**", description, "yes", fmt(figures[0]), fmt(figures[1]), *map(fmt_ratio, ratios)]


def _deployment(workflow: Workflow, deployment: Mapping[str, bytes]) -> list[str]:
    """Per region: its functions, and the steps that deploy and train them with each target built
    (`deployment`: the build's files by path, the stacks and templates among them)."""
    lines = ["", "## Deployment", ""]
    if len(workflow.regions) > 1:
        lines += [
            "Every region has its own bucket; each function reaches the other regions' buckets across the WAN "
            f"(environment `{PEERS_ENV}`). With SAM, deploy every region once, then again with the other "
            "regions' `BucketName` outputs as the `PeerBucket<Region>` parameters "
            "(`sam deploy --config-env <region> --parameter-overrides PeerBucketAwsEuWest1=<bucket> ...`, the "
            "names are in each template's Parameters). `cloudless-run` trains deployed functions one region at "
            "a time; it runs a workflow of several regions on this machine (`--invoker local`).",
            "",
        ]
    for region in workflow.regions:
        name = region.name
        lines += [f"### {name} ({region.provider})", ""]
        lines += _table(
            ["Function", "Stage", "Blocks", "Memory (MB)", "Replicas"],
            [
                [f"`{f.name}`", str(f.stage), _blocks(f.blocks), str(f.memory_mb), str(f.replicas)]
                for f in sorted(region.functions, key=lambda f: f.stage)
            ],
            "lrlrr",
        )
        lines += ["", "From the build folder:", ""] if deployment else [""]
        if f"regions/{name}/stack.yaml" in deployment:
            lines += _openfaas_steps(workflow, name, deployment)
        if f"regions/{name}/template.yaml" in deployment:
            lines += _sam_steps(workflow, name)
    return lines[:-1]


def _openfaas_steps(workflow: Workflow, region: str, deployment: Mapping[str, bytes]) -> list[str]:
    """OpenFaaS, word for word: from the region's folder (the stack's paths are relative to it), the
    template, the two secrets, the images' registry, the deploy, then the run from the build folder."""
    stack = yaml.safe_load(deployment[f"regions/{region}/stack.yaml"])
    gateway = stack.get("provider", {}).get("gateway", "<gateway>")
    run, bucket, prefix = workflow.run.name, region_bucket(workflow, region), workflow.storage.prefix
    registered = not stack_warnings(
        {f"regions/{region}/stack.yaml": deployment[f"regions/{region}/stack.yaml"].decode()}
    )
    lines = [
        f"**OpenFaaS** (the gateway at {gateway}, logged in with `faas-cli login`): the storage is an S3 bucket, "
        "the credentials a secret, every call carries the run's token.",
        "",
        "```bash",
        f"aws s3 mb s3://{bucket}     # the stack's storage ({STORAGE_ENV}): bucket names are global",
        "# ~/storage.env (outside the build folder): AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and AWS_DEFAULT_REGION,",
        "# one NAME=value per line, of a key that may use the bucket",
        f"faas-cli secret create {STORAGE_SECRET} --from-file ~/storage.env",
        f"openssl rand -hex 32 > ~/{run}.token && faas-cli secret create {TOKEN_SECRET} --from-file ~/{run}.token",
    ]
    if not registered:
        lines.append("# the images have no registry: recompile with --registry ghcr.io/<you> first (see Warnings)")
    else:
        functions: dict[str, dict[str, Any]] = stack.get("functions") or {}
        first: dict[str, Any] = next(iter(functions.values()), {})
        image = str(first.get("image", ""))
        lines.append(f"docker login {image.split('/')[0]}   # faas-cli up pushes the images there")
    lines.append(f"(cd regions/{region} && faas-cli template pull stack -f stack.yaml && faas-cli up -f stack.yaml)")
    if len(workflow.regions) == 1:  # several regions train under cloudless-run --invoker local only
        lines += [
            f"cloudless-run . --invoker openfaas --gateway {gateway} --token-file ~/{run}.token \\",
            f"  --storage s3://{bucket}/{prefix} --out trained   # with the same AWS_* variables set",
        ]
    return [*lines, "```", ""]


def _sam_steps(workflow: Workflow, region: str) -> list[str]:
    """AWS SAM: from the build folder (samconfig.toml's paths are relative to it), then the driver."""
    return [
        "**AWS SAM** (your AWS credentials, any boto3 source): the stack creates the run's bucket, the "
        "functions and the state machine; the driver stages the data and follows the executions.",
        "",
        "```bash",
        f"sam build --config-env {region} && sam deploy --config-env {region}",
        *(
            [f"cloudless-run . --invoker lambda --stack {stack_name(workflow, region)} --out trained"]
            if len(workflow.regions) == 1
            else []
        ),
        "```",
        "",
    ]


# --- comparison.svg --------------------------------------------------------------------------------


def _feasible(plan: TrainingPlan) -> list[tuple[str, Figures]]:
    """(name, figures) of each baseline that has a plan."""
    return [(b.name, b.predicted) for b in plan.baselines if b.feasible and b.predicted is not None]


def comparison_figure(plan: TrainingPlan) -> Figure:
    """Time and cost per iteration, this plan against each feasible baseline, as two bar panels."""
    entries = [("this plan", plan.predicted.iteration_s, plan.predicted.cost_usd, True)]
    entries += [(name, figures.iteration_s, figures.cost_usd, False) for name, figures in _feasible(plan)]
    infeasible = [b.name for b in plan.baselines if not b.feasible]
    height = 1.3 + 0.4 * len(entries) + (0.25 if infeasible else 0.0)
    figure = Figure(figsize=(10.0, height))
    bottom = (0.55 + (0.25 if infeasible else 0.0)) / height
    figure.subplots_adjust(left=0.13, right=0.98, top=1 - 0.6 / height, bottom=bottom, wspace=0.45)
    axes = figure.subplots(1, 2)
    figure.suptitle(f"{plan.model}: this plan against the baselines (shorter is better)", fontsize=10)
    y = list(range(len(entries)))
    colours = [_PLAN_COLOUR if mine else _BASELINE_COLOUR for *_, mine in entries]
    panels = (
        (axes[0], [e[1] for e in entries], "Time per iteration", "s"),
        (axes[1], [e[2] for e in entries], "Cost per iteration", "USD"),
    )
    for ax, values, title, unit in panels:
        bars = ax.barh(y, values, height=0.6, color=colours)
        for i, bar in enumerate(bars):
            bar.set_gid(f"bar-{unit.lower()}-{i}")
        top = max(values) or 1.0
        ax.set_xlim(0, top * 1.3)
        for yi, value in zip(y, values, strict=True):
            ax.text(value + top * 0.01, yi, f"{fmt(value)} {unit}", va="center", ha="left", fontsize=7)
        ax.set_yticks(y, [e[0] for e in entries])
        ax.invert_yaxis()
        ax.set_title(f"{title} ({unit})")
        for spine in ("top", "right"):
            ax.spines[spine].set_visible(False)
        ax.get_yticklabels()[0].set_fontweight("bold")
    if infeasible:
        figure.text(0.01, 0.08 / height, "Not shown (no feasible plan): " + ", ".join(infeasible), fontsize=7)
    return figure


# --- schedule.svg ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Bar:
    """One drawn rectangle: a span, or touching spans of one group merged; `label` is its micro-batch."""

    row: int
    start: float
    end: float
    group: str
    label: str | None


def group_of(kind: str) -> str:
    return _GROUPS.get(kind, kind)


def replicas_shown(plan: TrainingPlan) -> int:
    """How many replicas of each stage get rows (the first ones; replicas run alike, in turn)."""
    return max(1, min(MAX_REPLICAS_SHOWN, MAX_FUNCTIONS_SHOWN // max(1, len(plan.stages))))


def schedule_rows(plan: TrainingPlan) -> list[tuple[int, int, str]]:
    """(stage, replica, lane) of each row of the schedule, top to bottom."""
    cap = replicas_shown(plan)
    return [(s.index, j, lane) for s in plan.stages for j in range(min(cap, s.replicas)) for lane in LANES]


def _seconds_per_point(timeline: Timeline) -> float:
    width_pt = (_GANTT_WIDTH - _GANTT_LEFT - _GANTT_RIGHT) * 72
    return _x_limit(timeline) / width_pt


def _x_limit(timeline: Timeline) -> float:
    return timeline.iteration_s * 1.01 if timeline.iteration_s > 0 else 1.0


def schedule_bars(plan: TrainingPlan, timeline: Timeline) -> list[Bar]:
    """The bars the schedule draws, row by row. Touching spans of one group on one row merge when
    one of them is too narrow to see apart, and the pieces of a gradient sync always merge: this
    keeps the SVG small for large plans without changing what the picture shows."""
    rows = {key: i for i, key in enumerate(schedule_rows(plan))}
    per_row: dict[int, list[Span]] = {}
    for span in timeline.spans:
        row = rows.get((span.stage, span.replica, span.lane))
        if row is not None:
            per_row.setdefault(row, []).append(span)
    gap = _MERGE_GAP_PT * _seconds_per_point(timeline)
    narrow = _MIN_SPLIT_PT * _seconds_per_point(timeline)
    bars: list[Bar] = []
    for row in sorted(per_row):
        current: Bar | None = None
        for span in sorted(per_row[row], key=lambda s: (s.start, s.end, s.kind)):
            group = group_of(span.kind)
            label = None if span.micro_batch is None else str(span.micro_batch)
            touching = current is not None and current.group == group and span.start - current.end <= gap
            small = current is not None and min(current.end - current.start, span.end - span.start) < narrow
            if current is not None and touching and (small or span.kind.startswith("sync-")):
                current = Bar(row, current.start, max(current.end, span.end), group, None)
                continue
            if current is not None:
                bars.append(current)
            current = Bar(row, span.start, span.end, group, label)
        if current is not None:
            bars.append(current)
    return bars


def _gid(group: str) -> str:
    return "spans-" + re.sub(r"[^a-z0-9]+", "-", group.lower()).strip("-")


def schedule_figure(plan: TrainingPlan, timeline: Timeline) -> Figure:
    """The simulated iteration as a Gantt chart: a row per (stage, replica, lane), spans coloured by
    group, micro-batch numbers inside compute spans wide enough to hold them."""
    rows = schedule_rows(plan)
    bars = schedule_bars(plan, timeline)
    height = _GANTT_TOP + _GANTT_BOTTOM + _ROW_HEIGHT * max(len(rows), 3)
    figure = Figure(figsize=(_GANTT_WIDTH, height))
    figure.subplots_adjust(
        left=_GANTT_LEFT / _GANTT_WIDTH,
        right=1 - _GANTT_RIGHT / _GANTT_WIDTH,
        top=1 - _GANTT_TOP / height,
        bottom=_GANTT_BOTTOM / height,
    )
    ax = figure.add_subplot()
    cap = replicas_shown(plan)
    title = (
        f"{plan.model}: simulated iteration, {len(plan.stages)} stage{'s' if len(plan.stages) > 1 else ''}, "
        f"{plan.micro_batches} micro-batches "
        f"of {plan.micro_batch} ({plan.schedule}), {fmt_s(timeline.iteration_s)}"
    )
    if any(s.replicas > cap for s in plan.stages):
        title += f"; first {cap} replicas of each stage shown"
    ax.set_title(title, loc="left")

    half = _BAR_HEIGHT / 2
    # Touching spans (consecutive micro-batches) are told apart by a hairline gap cut from each bar's
    # end; cheaper in bytes than an edge stroke on every path.
    cut = _SEPARATOR_PT * _seconds_per_point(timeline)
    groups: dict[str, list[Bar]] = {}
    for bar in bars:
        groups.setdefault(bar.group, []).append(bar)
    order = [g for g in _COLOURS if g in groups] + sorted(g for g in groups if g not in _COLOURS)
    handles = []
    for group in order:
        colour = _COLOURS.get(group, _OTHER_COLOUR)
        vertices, codes = [], []
        for b in groups[group]:
            end = b.end - cut if b.end - b.start > 3 * cut else b.end
            top, bottom = b.row - half, b.row + half
            vertices += [(b.start, top), (end, top), (end, bottom), (b.start, bottom), (b.start, top)]
            codes += _RECT_CODES
        # One SVG path per group, a subpath per bar: a third of the bytes of one element per bar.
        path = Path(vertices, codes)
        path.should_simplify = False  # every bar must stay, however thin
        patch = PathPatch(path, facecolor=colour, edgecolor="none", linewidth=0, gid=_gid(group))
        patch.set_clip_on(False)  # every bar lies inside the axes
        ax.add_patch(patch)
        handles.append(Patch(facecolor=colour, label=group))

    per_point = _seconds_per_point(timeline)
    for bar in bars:
        if bar.label is None or bar.group not in ("forward", "backward"):
            continue
        needed = (0.62 * _LABEL_FONT * len(bar.label) + 2) * per_point
        if bar.end - bar.start >= needed:
            ax.text(
                (bar.start + bar.end) / 2,
                bar.row,
                bar.label,
                ha="center",
                va="center",
                fontsize=_LABEL_FONT,
                color="white" if bar.group == "forward" else "black",
            )

    ax.set_xlim(0, _x_limit(timeline))
    ax.set_ylim(len(rows) - 0.5, -0.5)
    labels = [f"s{s} r{j}  {lane}" if lane == LANES[0] else lane for s, j, lane in rows]
    ax.set_yticks(range(len(rows)), labels, fontsize=6 if len(rows) > 48 else 7)
    ax.tick_params(axis="y", length=0)
    ax.set_xlabel("seconds since the iteration started")
    ax.grid(axis="x", color="#e4e4e4", linewidth=0.5)
    ax.set_axisbelow(True)
    # Lines between functions, darker between stages.
    for i in range(3, len(rows), 3):
        new_stage = rows[i][0] != rows[i - 1][0]
        ax.axhline(i - 0.5, color="#707070" if new_stage else "#d0d0d0", linewidth=0.6 if new_stage else 0.4)
    figure.legend(
        handles=handles,
        loc="lower center",
        ncol=min(len(handles), 7) or 1,
        frameon=False,
        bbox_to_anchor=(0.5, 0.02 / height),
    )
    return figure
