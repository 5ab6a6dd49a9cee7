"""The build's report for people: report.md with the plan, its figures, the baselines, why this plan
and how to deploy it; with the two pictures of `report_figures`.

`render_report` returns relative path -> bytes. It draws the ir's objects (the plan, the simulated
timeline, the workflow) and the deployment files the build holds, and imports nothing of the compiler.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from ..ir.plan import PlannedStage, RegionSchedule, TrainingPlan
from ..ir.protocol import PEERS_ENV, STORAGE_ENV, STORAGE_SECRET, TOKEN_SECRET
from ..ir.timeline import Timeline
from ..ir.workflow import Workflow
from .checks.openfaas import stack_warnings
from .checks.quotas import quota_warnings
from .numbers import fmt, fmt_ratio, fmt_s, fmt_usd
from .platforms import region_bucket, stack_name
from .report_figures import comparison_figure, schedule_figure, svg_bytes

REPORT_MD = "report.md"
SCHEDULE_SVG = "report/schedule.svg"
COMPARISON_SVG = "report/comparison.svg"

#: modules listed in full in the stage table; longer lists become "first .. last (n modules)"
MAX_MODULES_LISTED = 3


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
    texts = {
        path: data.decode()
        for path, data in (deployment or {}).items()
        if path.startswith("regions/") and path.endswith(("/stack.yaml", "/template.yaml"))
    }
    # what the compile also warns of
    warnings = [*predicted.warnings, *stack_warnings(stacks), *quota_warnings(texts, workflow)]
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
    `explanation`, compiler/planner/explain.py), with its best plan and the term it loses most by."""
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
