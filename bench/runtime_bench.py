"""Runtime benchmarks, measured side by side in one run (the machine is shared: compare ratios).

1. Overhead: a 1-stage, 1-replica `cloudless-run` (the generated function in its own process,
   storage a local folder) against a plain PyTorch loop on the same model, data, samples, micro-
   batches and optimizer, both on one thread. Median time per iteration. Target: at most 1.3x.
2. Prediction: plans run under emulation (each function gets its tier's CPU share, bandwidth and
   request latency, as `cloudless-run --emulate` gives them) against the planner's cost model and
   simulator for the same plan. Median measured iteration time; each plan is profiled just before
   it runs, in 3 rounds, and the round with the median error is shown. Target: within 20%.

Everything runs on one thread per function: the profile that calibrates the cost model too, so
that one emulated vCPU is one of this machine's threads. Plans are kept to at most ~2 vCPUs in all,
since the machine has 2 cores.

    python bench/runtime_bench.py [--iterations 30] [--quick]
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"  # before torch loads: the profile and the plain loop on one thread

import argparse
import json
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from cloudless.compiler.build import package_files, write_build
from cloudless.compiler.lower import RegionTraining
from cloudless.compiler.pipeline import FrontEnd, FrontEndOptions, lower, run_front_end
from cloudless.compiler.planner.cost_model import CostModel, Plan, StageChoice
from cloudless.compiler.planner.plan import PlanOptions, build_problem
from cloudless.compiler.planner.simulate import simulate
from cloudless.ir.workflow import Workflow
from cloudless.runtimes.cli import main as cloudless_run

ROOT = Path(__file__).resolve().parents[1]
MODELS = {"mid_mlp": ROOT / "bench" / "models" / "mid_mlp.py", "mlp_digits": ROOT / "samples" / "mlp_digits.py"}


@dataclass
class Case:
    label: str
    model: str
    stages: list[tuple[int, int, int]]  # (first block, last block, replicas); -1 is the last block
    tier_mb: int
    schedule: str = "gpipe"


def front_end(model: str) -> FrontEnd:
    torch.set_num_threads(1)
    return run_front_end(FrontEndOptions(model_path=MODELS[model], profile_repeats=5))


def lower_case(result: FrontEnd, case: Case, iterations: int, build: Path) -> tuple[float, float, Workflow]:
    """Write the case's build; returns the cost model's and the simulator's iteration time."""
    last = len(result.chain.blocks) - 1
    options = PlanOptions(schedule=case.schedule)  # type: ignore[arg-type]
    region, problem = build_problem(result.chain, result.model_file, options)
    choices = tuple(StageChoice(f, last if b == -1 else b, case.tier_mb, r) for f, b, r in case.stages)
    plan = Plan(min(problem.micro_batches), choices)
    predicted = CostModel(problem).evaluate(plan).iteration_s
    simulated = simulate(problem, plan).iteration_s
    lowered = lower(
        result,
        [RegionTraining(region, plan, iterations, None)],
        None,
        iterations=iterations,
        global_batch=problem.global_batch,
        schedule=case.schedule,  # type: ignore[arg-type]
    )
    write_build(package_files(lowered), build)
    return predicted, simulated, lowered.workflow


def measured_run(build: Path, model: str, *options: str) -> dict:
    out = build.parent / f"run-{len(list(build.parent.glob('run-*')))}"
    code = cloudless_run([str(build), "--out", str(out), "--model", str(MODELS[model]), "-q", *options])
    if code != 0:
        sys.exit(f"cloudless-run failed ({code}); see {out}/logs")
    return json.loads((out / "metrics.json").read_text())


def plain_loop(result: FrontEnd, workflow: Workflow, iterations: int) -> float:
    """The same training in one process, data in memory: median seconds per iteration."""
    if str(ROOT) not in sys.path:  # the tests' reference trainer, from a checkout
        sys.path.insert(0, str(ROOT))
    from tests.reference import plain_training

    torch.set_num_threads(1)
    times: list[float] = []
    plain_training(
        result.model_file,
        workflow,
        workflow.regions[0].name,
        iterations,
        lambda _, seconds: times.append(seconds),
    )
    return statistics.median(times[1:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--quick", action="store_true", help="fewer iterations and cases (a smoke run)")
    args = parser.parse_args()
    iterations = 8 if args.quick else args.iterations
    work = Path(tempfile.mkdtemp(prefix="cloudless-runtime-bench-"))
    print(f"torch {torch.__version__}, {os.cpu_count()} cores; one thread per function; {iterations} iterations")

    print("\n1. Runtime overhead: 1 stage, 1 replica, against a plain PyTorch loop")
    print(f"   (median s per iteration; median of {1 if args.quick else 3} alternated round(s))")
    print(f"{'model':<12}{'plain s':>10}{'cloudless s':>13}{'ratio':>8}  target <= 1.30")
    misses = 0
    for model in ("mid_mlp", "mlp_digits"):
        result = front_end(model)
        build = work / f"overhead-{model}" / "build"
        _, _, workflow = lower_case(result, Case("1x1", model, [(0, -1, 1)], 1769), iterations, build)
        plains, ours_all = [], []
        for _ in range(1 if args.quick else 3):  # alternated, so that both see the machine's moods
            plains.append(plain_loop(result, workflow, iterations))
            ours_all.append(measured_run(build, model, "--iterations", str(iterations))["median_iteration_s"])
        plain, ours = statistics.median(plains), statistics.median(ours_all)
        ratio = ours / plain
        misses += ratio > 1.3
        print(f"{model:<12}{plain:>10.4f}{ours:>13.4f}{ratio:>8.2f}  {'PASS' if ratio <= 1.3 else 'MISS'}")

    rounds = 1 if args.quick else 3
    print("\n2. Measured under emulation against the planner's prediction (median s per iteration)")
    print(f"   each plan {rounds} round(s) of: profile, predict, run; the round with the median error")
    print(f"{'plan':<34}{'vCPUs':>6}{'model s':>9}{'sim s':>8}{'measured s':>12}{'error':>8}  target within 20%")
    n = len(front_end("mid_mlp").chain.blocks)
    half = n // 2 - 1
    cases = [
        Case("1 stage x 1, 1769 MB", "mid_mlp", [(0, -1, 1)], 1769),
        Case("1 stage x 1, 512 MB", "mid_mlp", [(0, -1, 1)], 512),
        Case("1 stage x 2 (sync), 1024 MB", "mid_mlp", [(0, -1, 2)], 1024),
        Case("2 stages x 1, 1024 MB", "mid_mlp", [(0, half, 1), (half + 1, -1, 1)], 1024),
        Case("2 stages x (2, 1), 1024 MB, GPipe", "mid_mlp", [(0, half, 2), (half + 1, -1, 1)], 1024),
        Case("2 stages x (2, 1), 1024 MB, 1F1B", "mid_mlp", [(0, half, 2), (half + 1, -1, 1)], 1024, "1f1b"),
    ]
    if args.quick:
        cases = cases[::2]
    for case in cases:
        # The machine is shared: a profile taken minutes before a run can be off by more than the
        # model's error. Profile just before each run, and report the median of a few rounds.
        outcomes = []
        for _ in range(rounds):
            build = work / f"emulated-{len(list(work.glob('emulated-*')))}" / "build"
            predicted, simulated, workflow = lower_case(front_end(case.model), case, iterations, build)
            metrics = measured_run(build, case.model, "--iterations", str(iterations), "--emulate")
            measured = metrics["median_iteration_s"]
            outcomes.append((measured / predicted - 1, predicted, simulated, measured))
        error, predicted, simulated, measured = sorted(outcomes)[len(outcomes) // 2]
        vcpus = sum(f.cpu_millis * f.replicas for f in workflow.regions[0].functions) / 1000
        misses += abs(error) > 0.2
        verdict = "PASS" if abs(error) <= 0.2 else "MISS"
        print(
            f"{case.label:<34}{vcpus:>6.2f}{predicted:>9.3f}{simulated:>8.3f}{measured:>12.3f}{error:>+8.0%}  {verdict}"
        )
    print(f"\nbuilds and run outputs (metrics.json, trace.json) under {work}")
    return 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main())
