"""`cloudless-compile MODEL.py -o BUILD/`: the command-line front door.

Bad input is one line on stderr and exit status 2; a failed --verify exits 1. The build is written
to a temporary folder beside BUILD and renamed into place, so a failed compile writes nothing; BUILD
must be new, empty or an earlier build (ir/folders.py), so a compile never replaces a user's files.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console

from ..codegen.platforms import TARGETS
from ..codegen.validate import check_build, deployment_warnings
from ..ir.arguments import OneLineParser
from ..ir.catalog import load_catalog, registry_problem
from ..ir.folders import FolderError, check_output_folder
from ..ir.graph import BufferRule
from ..ir.schema import SchemaError
from .errors import CompileError, display_path
from .frontend.coarsen import DEFAULT_BLOCKS
from .frontend.profile import profile_warnings
from .frontend.stand_ins import STAGED_WEIGHTS_BYTES
from .frontend.verify import TOLERANCE, eval_warning
from .pipeline import Compiled, CompileOptions, FrontEndOptions, compile_model
from .planner.baselines import ratio, ratio_text
from .planner.explain import summary_line
from .planner.plan import PlanOptions
from .planner.solver import solver_log

#: --verify without a plan splits into this many stages unless --stages says otherwise
DEFAULT_VERIFY_STAGES = 4

SLOW_STEPS = {
    "plan": "Planning",
    "retrace": "Tracing at the plan's micro-batch",
    "trace": "Tracing",
    "annotate": "Annotating",
    "profile": "Profiling blocks",
    "verify": "Verifying stages",
    "lower": "Generating the functions of",
    "write": "Writing and checking the build of",
}


#: asgd-ga and model-average: iterations of the whole training between two inter-region meetings
DEFAULT_SYNC_EVERY = 10


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="cloudless-compile",
        description="Compile a PyTorch training job (a model file) into pipelined serverless functions.",
    )
    parser.add_argument("model", type=Path, nargs="?", help="the model file (defines build_model and example_inputs)")
    parser.add_argument("-o", "--output", type=Path, help="build folder to write")
    parser.add_argument(
        "--check",
        type=Path,
        metavar="BUILD",
        help="validate an existing build folder (every file's digest; the workflow against itself, plan.json "
        "and the packages; schemas, platform limits, statelint, cfn-lint) and exit",
    )
    parser.add_argument(
        "--target",
        choices=["openfaas", "sam", "both"],
        default="both",
        help="which platforms' deployment files to write (default both)",
    )
    parser.add_argument(
        "--registry",
        metavar="PREFIX",
        help="push the OpenFaaS images to this registry and path, e.g. ghcr.io/acme or docker.io/acme (default: "
        "each region's registry in the catalog; without one, faas-cli builds the images but cannot push them)",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        help="micro-batch size to trace and profile (default: the smallest of TRAINING['micro_batch_sizes'], else 2)",
    )
    parser.add_argument(
        "--blocks",
        type=int,
        default=DEFAULT_BLOCKS,
        help=f"number of blocks to coarsen the graph into (default {DEFAULT_BLOCKS})",
    )
    parser.add_argument(
        "--leaf-module",
        action="append",
        default=[],
        metavar="NAME",
        help="keep modules of this class name, qualified class or module path as one node (repeatable)",
    )
    parser.add_argument(
        "--tracer",
        choices=["auto", "fx", "export"],
        default="auto",
        help="torch.fx, torch.export, or fx with export as fallback (default)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="timed profiling runs after one warm-up (default 3, at least 2; up to 3x while the fastest runs disagree)",
    )
    parser.add_argument(
        "--profile",
        type=Path,
        metavar="BLOCKS_JSON",
        help="reuse the block times of an earlier build's ir/blocks.json instead of measuring "
        "(the same model, options and profile give a byte-identical build)",
    )
    parser.add_argument(
        "--verify",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=f"chain the generated stages and compare loss, outputs and gradients with the unsplit model "
        f"(tolerance {TOLERANCE:g} relative); on by default when planning (at most a fifth of a compile on the "
        "samples): --no-verify skips it",
    )
    parser.add_argument(
        "--plan-only",
        action="store_true",
        help="plan from shapes: build the model with stand-ins for its weights (one element per parameter; a "
        "block's weights are made only while the profile times it), plan, and write plan.json and ir/ (no "
        "function packages, no report); the plan is the one a full compile makes (see docs/usage.md)",
    )
    parser.add_argument(
        "--weights",
        choices=("auto", "package", "staged"),
        default="auto",
        help="where the functions' initial weights come from: 'package' writes them into each function package; "
        "'staged' compiles on stand-ins (as --plan-only) and the build holds no parameter weights: cloudless-run "
        f"stages each stage's from the model file's build_model() into storage; 'auto' (default) stages a model "
        f"whose parameters take more than {STAGED_WEIGHTS_BYTES >> 30} GiB (see docs/usage.md)",
    )
    parser.add_argument(
        "--stages",
        type=int,
        help="plan exactly N pipeline stages (the MILP still chooses the cuts, tiers and replicas; --max-stages "
        "bounds the count instead); without a plan (--repeats 0), the stages --verify splits into (default 4)",
    )
    planning = parser.add_argument_group("planning (see docs/cost_model.md)")
    planning.add_argument("-c", "--catalog", type=Path, help="region catalog YAML (default: the built-in catalog)")
    planning.add_argument("--region", help="region to plan for (default: the catalog's first)")
    planning.add_argument(
        "--regions",
        metavar="A,B,...",
        help="train across these catalog regions ('all': every one): where data lies (load_shard), what "
        "moves, which regions train and with which plan are chosen jointly",
    )
    planning.add_argument(
        "--sync",
        choices=["sync", "asgd-ga", "model-average"],
        default="asgd-ga",
        help="between regions: synchronous SGD (every iteration's gradients meet across regions), "
        "asynchronous SGD with gradient accumulation through a server region, or model averaging at a "
        "barrier (default asgd-ga)",
    )
    planning.add_argument(
        "--sync-every",
        type=int,
        default=None,
        metavar="ITERATIONS",
        help="asgd-ga and model-average: regions meet every this many iterations of the whole training "
        f"(default {DEFAULT_SYNC_EVERY}; 2 or more: meeting every iteration is --sync sync)",
    )
    planning.add_argument(
        "--objective",
        choices=["cost", "time", "cost-under-deadline", "time-under-budget"],
        default="cost",
        help="what to minimise (default cost)",
    )
    planning.add_argument(
        "--deadline",
        type=float,
        metavar="SECONDS",
        help="the whole run (TRAINING['iterations']) must finish within this many seconds",
    )
    planning.add_argument("--budget", type=float, metavar="USD", help="the whole run must cost at most this")
    planning.add_argument("--max-functions", type=int, help="at most this many functions at once")
    planning.add_argument("--max-stages", type=int, default=16, help="at most this many pipeline stages (default 16)")
    planning.add_argument("--replicas", default="1,2,4,8", help="replica counts a stage may use (default 1,2,4,8)")
    planning.add_argument("--schedule", choices=["gpipe", "1f1b"], default="gpipe", help="micro-batch schedule")
    planning.add_argument(
        "--solver-time-limit",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="per micro-batch size; the plan then reports its proven gap (default 10)",
    )
    parser.add_argument("-q", "--quiet", action="store_true", help="print only errors")
    parser.add_argument("--verbose", action="store_true", help="also print the MILP solvers' banner and log")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print("cloudless-compile: interrupted; nothing was written", file=sys.stderr)
        return 130


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # Errors: one unwrapped line each, and -q never hides them (it quiets the summary and progress).
    console = Console(stderr=True, highlight=False, soft_wrap=True)
    if args.check is not None:
        return check_command(args.check, Console(quiet=args.quiet, highlight=False, soft_wrap=True))
    if args.model is None or args.output is None:
        parser.error("a model file and -o BUILD are required (or --check BUILD)")
    try:
        # before any pass: a refusal must not cost a minute of profiling first
        check_output_folder(args.output, "build", protected=[args.model])
    except FolderError as exc:
        console.print(f"cloudless-compile: error: {exc}", markup=False)
        return 2
    # Plain, unwrapped lines for the summary: it is read in terminals and in CI logs alike.
    out = Console(quiet=args.quiet, highlight=False, soft_wrap=True)
    for name, value in (
        ("--batch-size", args.batch_size),
        ("--blocks", args.blocks),
        ("--stages", args.stages),
        ("--max-stages", args.max_stages),
        ("--max-functions", args.max_functions),
    ):
        if value is not None and value < 1:
            console.print(f"cloudless-compile: error: {name} must be at least 1", style="red", markup=False)
            return 2
    try:
        replicas = tuple(sorted({int(r) for r in args.replicas.split(",")}))
        if not replicas or min(replicas) < 1:
            raise ValueError
    except ValueError:
        console.print("cloudless-compile: error: --replicas takes positive integers like 1,2,4,8", markup=False)
        return 2
    regions: tuple[str, ...] = ()
    if args.regions:
        if args.region:
            console.print("cloudless-compile: error: give --region or --regions, not both", markup=False)
            return 2
        if args.regions != "all":
            regions = tuple(name.strip() for name in args.regions.split(",") if name.strip())
    # The catalog and the regions named, before any pass (tracing and profiling take a while).
    try:
        catalog = load_catalog(args.catalog)
        if args.regions == "all":
            regions = tuple(r.name for r in catalog.regions)
        for name in (args.region, *regions):
            catalog.region(name)
    except SchemaError as exc:
        console.print(f"cloudless-compile: error: {exc}", markup=False)
        return 2
    for name, number in (
        ("--deadline", args.deadline),
        ("--budget", args.budget),
        ("--solver-time-limit", args.solver_time_limit),
    ):
        if number is not None and not (math.isfinite(number) and number > 0):
            console.print(f"cloudless-compile: error: {name} {number}: expected a positive number", markup=False)
            return 2
    if args.repeats < 0:
        console.print(f"cloudless-compile: error: --repeats {args.repeats}: expected 0 or more", markup=False)
        return 2
    if args.sync_every is not None and args.sync == "sync":
        console.print(
            f"cloudless-compile: error: --sync-every {args.sync_every} with --sync sync: synchronous cross-region SGD "
            "meets every iteration; --sync-every is for asgd-ga and model-average",
            markup=False,
        )
        return 2
    args.sync_every = DEFAULT_SYNC_EVERY if args.sync_every is None else args.sync_every
    if args.sync_every < 1:
        console.print("cloudless-compile: error: --sync-every must be at least 1", markup=False)
        return 2
    if args.sync_every == 1 and args.sync != "sync":
        console.print(
            f"cloudless-compile: error: --sync-every 1 with --sync {args.sync}: regions that meet every iteration "
            "train synchronously; use --sync sync (synchronous cross-region SGD)",
            markup=False,
        )
        return 2
    if args.registry is not None and (problem := registry_problem(args.registry)):
        console.print(f"cloudless-compile: error: --registry {args.registry!r}: {problem}", markup=False)
        return 2
    targets = TARGETS if args.target == "both" else frozenset({args.target})
    objective = args.objective
    if objective == "cost" and args.deadline is not None:
        objective = "cost-under-deadline"
    if objective == "time" and args.budget is not None:
        objective = "time-under-budget"
    plan_options = PlanOptions(
        catalog=args.catalog,
        region=args.region,
        objective=objective,
        deadline=args.deadline,
        budget=args.budget,
        max_functions=args.max_functions,
        schedule=args.schedule,
        max_stages=args.max_stages,
        stages=args.stages,
        replicas=replicas,
        time_limit=args.solver_time_limit,
        regions=regions,
        sync=args.sync,
        sync_every=args.sync_every,
        targets=targets,
        registry=args.registry,
    )
    planning = args.repeats > 0 or args.profile is not None
    # verified unless --no-verify when a plan is made; without one (front end only), with --verify
    verify = args.verify if args.verify is not None else planning and not args.plan_only
    if args.plan_only and (args.verify or not planning):
        problem = "--verify (stand-ins hold no weights to compare)" if args.verify else "--repeats 0 (nothing to plan)"
        console.print(f"cloudless-compile: error: --plan-only cannot go with {problem}", markup=False)
        return 2
    if args.weights == "staged" and args.verify:
        console.print(
            "cloudless-compile: error: --weights staged cannot go with --verify (stand-ins hold no weights to compare)",
            markup=False,
        )
        return 2
    stand_ins = True if args.plan_only else {"auto": None, "package": False, "staged": True}[args.weights]
    options = CompileOptions(
        FrontEndOptions(
            model_path=args.model,
            batch_size=args.batch_size,
            num_blocks=args.blocks,
            leaf_modules=tuple(args.leaf_module),
            tracer=args.tracer,
            profile_repeats=max(args.repeats, 0),
            profile_from=args.profile,
            stand_ins=stand_ins,
        ),
        packages=not args.plan_only,
        plan=plan_options if planning else None,
        verify_stages=(args.stages or DEFAULT_VERIFY_STAGES) if verify else 0,
        targets=targets,
        output=args.output,
    )

    @contextmanager
    def step(name: str) -> Iterator[None]:
        if name in SLOW_STEPS and not args.quiet:
            with console.status(f"{SLOW_STEPS[name]} {display_path(args.model)}…"):
                yield
        else:
            yield

    token = solver_log.set(args.verbose)
    try:
        result = compile_model(options, step)
    except (CompileError, SchemaError, FolderError) as exc:
        code = exc.exit_code if isinstance(exc, CompileError) else 2
        if isinstance(exc, SchemaError):
            exc = SchemaError(f"the generated build failed its check (a Cloudless bug, please report it): {exc}")
        Console(stderr=True, highlight=False, soft_wrap=True).print(f"cloudless-compile: error: {exc}", markup=False)
        return code
    finally:
        solver_log.reset(token)
    if args.stages is not None and options.plan is None and not verify:
        # after the compile: an error stays the one line on stderr
        console.print(
            f"cloudless-compile: note: --stages {args.stages} is ignored: without a plan (--repeats 0) it sets the "
            "split --verify checks, and this compile does not verify",
            markup=False,
        )
    print_summary(out, result, args.output, requested_blocks=args.blocks)
    workflow = result.workflow
    if workflow is not None and any(f.staged_parameters for r in workflow.regions for f in r.functions):
        console.print(
            "cloudless-compile: note: the build holds no parameter weights (--weights "
            f"{args.weights}): cloudless-run stages them from the model file's build_model()"
            + ("; --verify was skipped (stand-ins hold no weights to compare)" if args.verify else ""),
            markup=False,
        )
    # An unstable or loaded profile (compiler/frontend/profile.py): on stderr, after the summary, and -q keeps them.
    for warning in profile_warnings(result.front.chain, reused_from=args.profile):
        console.print(f"cloudless-compile: warning: {warning}", markup=False)
    eval_differs = eval_warning(result.verify) if result.verify else None
    if eval_differs:
        console.print(f"cloudless-compile: warning: {eval_differs}", markup=False)
    for warning in deployment_warnings(args.output):  # e.g. OpenFaaS images without a registry to push to
        console.print(f"cloudless-compile: warning: {warning}", markup=False)
    return 0


def check_command(build: Path, out: Console) -> int:
    try:
        check_build(build)
    except SchemaError as exc:
        Console(stderr=True, highlight=False, soft_wrap=True).print(f"cloudless-compile: error: {exc}", markup=False)
        return 2
    out.print(
        f"{display_path(build)}: every check passed (file digests; workflow, plan and packages consistent; "
        "schemas, platform limits, statelint, cfn-lint)"
    )
    warnings = Console(stderr=True, highlight=False, soft_wrap=True)
    for warning in deployment_warnings(build):
        warnings.print(f"cloudless-compile: warning: {warning}", markup=False)
    return 0


def buffer_rules_text(rules: dict[str, BufferRule]) -> str:
    """What the forward changes, and how replicas keep it as the plain loop's (buffer_rules.py)."""
    kept = [name for name, rule in rules.items() if rule.rule == "sequence"]
    averaged = sum(rule.rule == "average" for rule in rules.values())
    counted = sum(rule.rule == "count" for rule in rules.values())
    parts = [f"{averaged} running statistics", f"{counted} counters"] if averaged or counted else []
    text = f"{len(rules)} changed by the forward"
    if parts:
        text += f": {', '.join(parts)} (replicas end each iteration with the plain loop's values)"
    if kept:
        shown = ", ".join(kept[:3]) + (f" and {len(kept) - 3} more" if len(kept) > 3 else "")
        text += f"{';' if parts else ':'} in sequence, so their stages run one replica: {shown}"
    return text


def print_plan(out: Console, result: Compiled) -> None:
    plan, timeline = result.plan, result.timeline
    assert plan is not None and timeline is not None and result.plan_options is not None
    solution, problem = plan.solution, plan.problem
    ev = solution.evaluation
    gap = _gap_text(solution.gap)
    out.print(
        f"  plan        {plan.region.name}, objective {result.plan_options.objective}, {problem.schedule}, "
        + (f"{problem.min_stages} stages (--stages), " if result.plan_options.stages else "")
        + f"micro-batch {solution.plan.micro_batch} x {problem.global_batch // solution.plan.micro_batch}: "
        f"{solution.status} (gap {gap}, {solution.solver}, {solution.solve_s:.1f} s)"
    )
    out.print("              stage  blocks   tier MB  replicas  memory MB  fwd+bwd s/mb  modules")
    for i, (choice, terms) in enumerate(zip(solution.plan.stages, ev.stages, strict=True)):
        modules = [m for b in result.front.chain.blocks[choice.first : choice.last + 1] for m in b.modules]
        shown = f"{modules[0]} .. {modules[-1]}" if len(modules) > 1 else (modules[0] if modules else "-")
        out.print(
            f"              {i:>5}  {choice.first:>2}-{choice.last:<3}  {choice.tier_mb:>7}  {choice.replicas:>8}  "
            f"{terms.memory_mb:>9.0f}  {terms.forward_s + terms.backward_s:>12.3f}  {shown}"
        )
    out.print(
        f"  predicted   {ev.iteration_s:.2f} s (simulated {timeline.iteration_s:.2f} s) and "
        f"{ev.cost_usd * 1e3:.4f} mUSD per iteration; "
        f"{problem.iterations} iterations: {ev.iteration_s * problem.iterations:.0f} s, "
        f"{ev.cost_usd * problem.iterations:.4f} USD"
    )
    if plan.run_length is not None:
        out.print(f"  iterations  {plan.run_length.iterations} ({plan.run_length.source})")
    for warning in ev.warnings:
        out.print(f"  [yellow]warning[/yellow]     {warning}")
    for b in plan.baselines:
        if b.evaluation is None:
            out.print(f"  baseline    {b.name}: cannot fit: {b.reason}")
        else:
            time_ratio, cost_ratio = b.ratios(ev)
            out.print(
                f"  baseline    {b.name}: {b.evaluation.iteration_s:.2f} s, {b.evaluation.cost_usd * 1e3:.4f} mUSD "
                f"per iteration (ours: {ratio_text(time_ratio)} time, {ratio_text(cost_ratio)} cost)"
            )
    # Why this plan: compiler/planner/explain.py's comparison, as the plan pass recorded it (plan.json's).
    why = summary_line(result.record) if result.record is not None else None
    if why is not None:
        out.print(f"  why         {why}", markup=False)


def print_regions(out: Console, result: Compiled) -> None:
    """Several regions: who trains on what, the sync, the figures against each restriction."""
    assert result.plan is not None
    geo = result.plan.geo
    if geo is None:
        return
    problem, solution = geo.problem, geo.solution
    ev = solution.evaluation
    server = solution.plan.server
    out.print(
        f"  regions     {problem.sync}, {problem.rounds} rounds"
        + (f", server {problem.sites[server].name}" if server is not None and problem.sync == "asgd-ga" else "")
        + f": {solution.status} (gap {_gap_text(solution.gap)}, {solution.solve_s:.1f} s)"
    )
    runs = {region.name: region.iterations for region in result.workflow.regions} if result.workflow else {}
    for site, figures in zip(problem.sites, ev.regions, strict=True):
        if figures is None:
            out.print(f"              {site.name}: does not train ({site.data} samples held)")
            continue
        iterations = runs.get(site.name) or round(figures.iterations)
        out.print(
            f"              {site.name}: {site.data} samples held, trains on {figures.data:.0f} for "
            f"{iterations} iterations: work {figures.work_s:.1f} s, sync {figures.sync_s:.1f} s, "
            f"moves in {figures.move_in_s:.1f} s"
        )
    for (a, b), parts in solution.plan.moves:
        out.print(
            f"  moves       {problem.sites[a].name} -> {problem.sites[b].name}: "
            f"{problem.sites[a].data * parts / problem.parts:.0f} samples"
        )
    trainers = [s.name for s, f in zip(problem.sites, ev.regions, strict=True) if f is not None]
    if len(trainers) == 1:
        out.print(
            f"  note        only {trainers[0]} trains: cheaper or faster than training across regions under this "
            "catalog and objective (see the baselines)"
        )
    out.print(f"  predicted   training {ev.training_s:.1f} s, {ev.cost_usd:.4f} USD across regions")
    for baseline in geo.baselines:
        if baseline.solution is None:
            out.print(f"  baseline    {baseline.name}: {baseline.reason}")
            continue
        other = baseline.solution.evaluation
        out.print(
            f"  baseline    {baseline.name}: {other.training_s:.1f} s, {other.cost_usd:.4f} USD "
            f"(ours: {ratio_text(ratio(ev.training_s, other.training_s))} time, "
            f"{ratio_text(ratio(ev.cost_usd, other.cost_usd))} cost)"
        )


def human_flops(flops: int) -> str:
    for unit, scale in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3)):
        if flops >= scale:
            return f"{flops / scale:.2f} {unit}"
    return f"{flops} FLOP"


def print_summary(out: Console, result: Compiled, output: Path, requested_blocks: int) -> None:
    graph, chain, files = result.front.graph, result.front.chain, result.files
    compute = sum(1 for n in graph.nodes if n.op in ("call_function", "call_method", "call_module"))
    out.print(f"{graph.model}: traced with torch.{graph.tracer} at micro-batch {graph.batch_size}")
    out.print(f"  nodes       {len(graph.nodes)} ({compute} compute)")
    note = ""
    if len(chain.blocks) < requested_blocks:
        note = f" ({requested_blocks} requested: fewer valid cut points, or single ops larger than a block)"
    out.print(f"  blocks      {len(chain.blocks)}{note}")
    out.print(
        f"  parameters  {graph.param_count:,} ({graph.param_bytes / 2**20:.1f} MiB)"
        + (f", {len(chain.shared_params)} shared across blocks" if chain.shared_params else "")
    )
    out.print(f"  forward     {human_flops(graph.flops)} per micro-batch")
    if chain.machine:
        fwd = sum(b.forward_s for b in chain.blocks)
        bwd = sum(b.backward_s for b in chain.blocks)
        out.print(
            f"  measured    forward {fwd * 1e3:.1f} ms, backward {bwd * 1e3:.1f} ms "
            f"({chain.machine.threads} threads, {chain.machine.reference_gflops:.1f} GFLOP/s reference)"
        )
    if result.verify:
        v = result.verify
        split = " | ".join(f"{first}-{last}" for first, last in v.ranges)
        out.print(
            f"  verified    {split_text(v.stages)} of {v.split_from} (blocks {split}) at micro-batch "
            f"{v.batch_size}: largest gradient error {v.gradient_error:.3g} "
            f"({v.compared_gradients} gradients), loss {v.loss_error:.3g}, outputs {v.output_error:.3g}, "
            f"buffers {v.buffer_error:.3g}, eval-mode outputs {v.eval_error:.3g} (tolerance {TOLERANCE:g})"
        )
    if graph.buffer_rules:
        out.print(f"  buffers     {buffer_rules_text(graph.buffer_rules)}")
    if result.plan is not None:
        print_plan(out, result)
        print_regions(out, result)
    out.print("  time        " + ", ".join(f"{k} {v:.2f}s" for k, v in result.timings.items()))
    top = sorted({path.split("/")[0] + ("/" if "/" in path else "") for path in files})
    size = sum(len(data) for data in files.values())
    out.print(f"  wrote       {display_path(output)}/: {len(files)} files, {size / 2**20:.1f} MiB ({', '.join(top)})")


def split_text(stages: int) -> str:
    return "1 stage" if stages == 1 else f"{stages} stages"


def _gap_text(gap: float) -> str:
    return "unknown" if gap == float("inf") else f"{gap:.2%}"


if __name__ == "__main__":
    sys.exit(main())
