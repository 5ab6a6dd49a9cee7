"""Several regions: time to a test accuracy and cost of sync, model averaging and ASGD-GA, under WAN emulation.

    python bench/geo_bench.py [--quick] [--target-accuracy 0.95] [--levels 60 80 100 ... 200] [--repeats 3]

The job is bench/models/digits_geo3.py (the digits MLP; 60% / 25% / 15% of its train split in
aws-us-east-1 / aws-eu-west-1 / aws-ap-southeast-1) on the catalog bench/geo3.yaml: three regions
with different prices, capacities (`max_functions`, `max_total_memory_mb`) and WAN links, and data
residency (aws-eu-west-1's data may not move; aws-ap-southeast-1's only to aws-us-east-1).

1. Compiles the job across the three regions once per strategy (`cloudless-compile --regions A,B,C
   --sync sync|model-average|asgd-ga`, the cost objective) with the same block times: those of
   bench/geo3_blocks.json (`--profile`, taken on a quiet machine: a busy one profiled these tiny blocks
   20-100x slow), or with `--profile measure` the first compile's own profile.
2. (a) Time to accuracy. Runs every build with `cloudless-run --emulate` (each region's request
   latency and CPU share, every cross-region request over the catalog's WAN link) at increasing
   `--iterations N` (N scales every region's planned iterations and rounds by N / 200), the three
   strategies alternated at each N, `--repeats` runs each. A strategy's time to accuracy is the
   median training wall time (metrics.json `seconds`: from the controller's start to the last
   region's end, including the function processes' start-up, each importing torch as a cold start
   would; not cloudless-run's own start-up, the data staging or the test evaluation) at the smallest N whose
   median final test accuracy (the whole test split, 360 samples) reaches the target; once reached,
   a strategy runs no larger N. Ratios: sync's time over each strategy's (the speed-up; target
   >= 1.7x for ASGD-GA and model averaging).
3. (b) Cost. The measured cost of those runs (metrics.json `cost.total_usd`: functions' GB-seconds
   and invocations, storage requests and egress at each region's prices), and for every strategy
   the planned cost of its chosen (elastic) plan against every naive placement in plan.json
   `regions.baselines` (data-local, equal-split, single-region:*; infeasible ones with the reason):
   the ratio to the cheapest one the catalog's residency and capacity allow (target: <= 0.91,
   i.e. at least 9% cheaper).

Planned and measured costs differ in scale: the plan prices the profile's block times at each
function's tier (a profile taken on this shared machine), the run prices what the functions took
here. The ASGD-GA runs are timed by the machine (pushes land in the order they happen), so their
accuracy varies between runs; sync and model averaging are deterministic (the workflow's seed).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
MODEL = ROOT / "bench" / "models" / "digits_geo3.py"
CATALOG = ROOT / "bench" / "geo3.yaml"
#: the job's block times, profiled on this kind of machine while quiet (the compile's CPU share 1.0):
#: on a busy one the profile of these sub-millisecond blocks came out 20-100x slow, and the plans with it
PROFILE = ROOT / "bench" / "geo3_blocks.json"
REGIONS = ("aws-us-east-1", "aws-eu-west-1", "aws-ap-southeast-1")
STRATEGIES = ("sync", "model-average", "asgd-ga")
SPEEDUP_TARGET = 1.7
COST_TARGET = 0.91  # the elastic plan at most 0.91x the best allowed naive placement's cost


class BenchError(RuntimeError):
    pass


def tool(name: str) -> str:
    path = BIN / name
    if not path.exists():
        raise BenchError(f"{path} not found: run this with the project's venv (.venv/bin/python bench/geo_bench.py)")
    return str(path)


def call(command: list[str], what: str, timeout: float) -> str:
    """Run a command; on failure, a BenchError with its exit status and the end of its output."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired as exc:
        raise BenchError(f"{what}: no result after {timeout:.0f} s: {' '.join(command)}") from exc
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
        raise BenchError(f"{what} failed (exit {done.returncode}): {' '.join(command)}\n{tail}")
    return done.stdout


def compile_all(work: Path, objective: str, profile: Path | None) -> dict[str, Path]:
    builds: dict[str, Path] = {}
    for strategy in STRATEGIES:
        build = work / f"build-{strategy}"
        command = [
            tool("cloudless-compile"),
            str(MODEL),
            "-c",
            str(CATALOG),
            "-o",
            str(build),
            "--regions",
            ",".join(REGIONS),
            "--sync",
            strategy,
            "--objective",
            objective,
            "--target",
            "openfaas",
            "-q",
        ]
        if profile is not None:
            command += ["--profile", str(profile)]
        call(command, f"cloudless-compile --sync {strategy}", timeout=900)
        if not (build / "plan.json").is_file():
            raise BenchError(f"cloudless-compile --sync {strategy} wrote no {build}/plan.json")
        profile = profile or build / "ir" / "blocks.json"
        builds[strategy] = build
    return builds


def iterations_shown(per_region: dict[str, int]) -> str:
    """'us 150 + eu 50': each training region's iterations, by the middle part of its name."""
    return " + ".join(f"{name.split('-')[1]} {n}" for name, n in per_region.items())


def run_once(build: Path, out: Path, iterations: int) -> dict[str, Any]:
    shutil.rmtree(out, ignore_errors=True)
    command = [tool("cloudless-run"), str(build), "--emulate", "-q", "--out", str(out), "--iterations", str(iterations)]
    call(command, f"cloudless-run {build.name} --iterations {iterations}", timeout=1800)
    metrics = json.loads((out / "metrics.json").read_text())
    test = metrics.get("test") or {}
    if "accuracy" not in test:
        raise BenchError(f"{out}/metrics.json has no test accuracy (test: {test})")
    regions = metrics.get("regions") or {}
    per_region = {name: regions[name].get("iterations") for name in REGIONS if name in regions}
    result = {
        "seconds": float(metrics["seconds"]),
        "accuracy": float(test["accuracy"]),
        "cost": float(metrics["cost"]["total_usd"]),
        "iterations": per_region,
    }
    if "asgd_staleness" in metrics:
        result["staleness"] = metrics["asgd_staleness"]
    shutil.rmtree(out, ignore_errors=True)  # keeps /tmp small; the figures are in `result`
    return result


def time_to_accuracy(
    builds: dict[str, Path], work: Path, levels: list[int], repeats: int, target: float
) -> dict[str, dict[str, Any]]:
    """Per strategy: every level's runs, and the first level whose median accuracy reaches the target."""
    found: dict[str, dict[str, Any]] = {s: {"levels": {}, "reached": None} for s in STRATEGIES}
    for level in levels:
        pending = [s for s in STRATEGIES if found[s]["reached"] is None]
        if not pending:
            break
        for repeat in range(repeats):
            for strategy in pending:  # alternated: the machine's load falls on every strategy alike
                result = run_once(builds[strategy], work / f"run-{strategy}", level)
                found[strategy]["levels"].setdefault(level, []).append(result)
                print(
                    f"  {strategy:<13} N={level:<4} run {repeat + 1}/{repeats}: {result['seconds']:7.2f} s, "
                    f"accuracy {result['accuracy']:.1%}, cost {result['cost'] * 1000:.3f} mUSD, iterations "
                    + iterations_shown(result["iterations"]),
                    flush=True,
                )
        for strategy in pending:
            runs = found[strategy]["levels"][level]
            if statistics.median(r["accuracy"] for r in runs) >= target:
                found[strategy]["reached"] = level
    return found


def summary(runs: list[dict[str, Any]]) -> dict[str, float]:
    return {key: statistics.median(r[key] for r in runs) for key in ("seconds", "accuracy", "cost")}


def planned(build: Path) -> dict[str, Any]:
    regions = json.loads((build / "plan.json").read_text())["regions"]
    baselines = regions["baselines"]
    allowed = [b for b in baselines if b["feasible"] and b["cost_usd"] is not None]
    best = min(allowed, key=lambda b: b["cost_usd"]) if allowed else None
    sites = {s["name"]: s.get("runs_iterations") for s in regions["sites"] if s.get("trains")}
    return {
        "cost": regions["cost_usd"],
        "baselines": baselines,
        "best": best,
        "sites": sites,
        "moves": regions["moves"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="levels 60 100 140 200, one run each (about 3 minutes)")
    parser.add_argument("--target-accuracy", type=float, default=0.95, help="test accuracy to reach (default 0.95)")
    parser.add_argument(
        "--levels",
        type=int,
        nargs="+",
        default=None,
        help="--iterations values to try, ascending (default 60 80 ... 200 in steps of 20; --quick: 60 100 140 200)",
    )
    parser.add_argument("--repeats", type=int, default=None, help="runs per strategy and level (default 3; --quick: 1)")
    parser.add_argument("--objective", default="cost", help="cloudless-compile --objective (default cost)")
    parser.add_argument(
        "--profile",
        metavar="BLOCKS_JSON",
        default=str(PROFILE.relative_to(ROOT)),
        help="the model's block times (a build's ir/blocks.json of the same model), so that the plans are the "
        f"same from run to run (default {PROFILE.relative_to(ROOT)}, taken on a quiet machine); 'measure': "
        "profile afresh",
    )
    parser.add_argument("--keep", metavar="DIR", help="keep the builds in DIR (default: a temporary folder)")
    args = parser.parse_args(argv)
    levels = sorted(set(args.levels or ([60, 100, 140, 200] if args.quick else [60, 80, 100, 120, 140, 160, 180, 200])))
    repeats = args.repeats or (1 if args.quick else 3)

    began = time.monotonic()
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="geo-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        print(
            f"{MODEL.relative_to(ROOT)} on {CATALOG.relative_to(ROOT)} across {', '.join(REGIONS)}; "
            f"objective {args.objective}; cloudless-run --emulate; target test accuracy {args.target_accuracy:.1%}; "
            f"levels {levels} (of 200 planned iterations), median of {repeats}; {os.cpu_count()} cores",
            flush=True,
        )
        profile = None if args.profile == "measure" else (ROOT / args.profile).resolve()
        builds = compile_all(work, args.objective, profile)
        plans = {s: planned(builds[s]) for s in STRATEGIES}
        for strategy in STRATEGIES:
            plan = plans[strategy]
            moves = ", ".join(f"{m['from']}->{m['to']} {m['samples']:g}" for m in plan["moves"]) or "none"
            sites = ", ".join(f"{name} {n}" for name, n in plan["sites"].items())
            print(f"plan {strategy}: trains {sites} iterations; moves (samples) {moves}", flush=True)
        found = time_to_accuracy(builds, work, levels, repeats, args.target_accuracy)
    except BenchError as exc:
        print(f"geo_bench: {exc}", file=sys.stderr)
        return 2
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    print()
    print(f"(a) time to {args.target_accuracy:.1%} test accuracy (median of {repeats}; cloudless-run --emulate)")
    header = (
        f"{'strategy':<14} {'N':>4} {'iterations per region':>24} {'accuracy':>8} {'seconds':>8} "
        f"{'speed-up vs sync':>16} {'measured mUSD':>13}"
    )
    print(header)
    print("-" * len(header))
    reached: dict[str, dict[str, float] | None] = {}
    for strategy in STRATEGIES:
        level = found[strategy]["reached"]
        last = level if level is not None else max(found[strategy]["levels"])
        runs = found[strategy]["levels"][last]
        figures = summary(runs)
        reached[strategy] = figures if level is not None else None
        per_region = iterations_shown(runs[0]["iterations"])
        note = "" if level is not None else "  (target not reached)"
        print(
            f"{strategy:<14} {last:>4} {per_region:>24} {figures['accuracy']:>8.1%} {figures['seconds']:>8.2f} "
            f"{'':>16} {figures['cost'] * 1000:>13.3f}{note}"
        )
    base = reached["sync"]
    speedups: dict[str, float | None] = {}
    for strategy in STRATEGIES[1:]:
        mine = reached[strategy]
        speedups[strategy] = base["seconds"] / mine["seconds"] if base and mine else None
        shown = f"{speedups[strategy]:.2f}x" if speedups[strategy] is not None else "n/a"
        print(f"  sync / {strategy}: {shown}")
    print("  every run:")
    for strategy in STRATEGIES:
        for level, runs in found[strategy]["levels"].items():
            figures = summary(runs)
            print(
                f"    {strategy:<13} N={level:<4} median {figures['seconds']:6.2f} s, accuracy "
                + ", ".join(f"{r['accuracy']:.1%}" for r in runs)
                + f"; measured {figures['cost'] * 1000:.3f} mUSD"
            )

    print()
    print("(b) planned cost of the chosen (elastic) plan against every naive placement (plan.json regions.baselines)")
    names = [b["name"] for b in plans["sync"]["baselines"]]
    header = f"{'strategy':<14} {'plan mUSD':>9} " + " ".join(f"{n:>{max(len(n), 12)}}" for n in names)
    header += f" {'best allowed':>12} {'ratio':>6}"
    print(header)
    print("-" * len(header))
    ratios: dict[str, float | None] = {}
    for strategy in STRATEGIES:
        plan = plans[strategy]
        cells = []
        for n, baseline in zip(names, plan["baselines"], strict=True):
            width = max(len(n), 12)
            cells.append(
                f"{baseline['cost_usd'] * 1000:>{width}.3f}" if baseline["feasible"] else f"{'infeasible':>{width}}"
            )
        best = plan["best"]
        ratios[strategy] = plan["cost"] / best["cost_usd"] if best else None
        print(
            f"{strategy:<14} {plan['cost'] * 1000:>9.3f} "
            + " ".join(cells)
            + f" {best['name'] if best else 'none':>12} "
            + (f"{ratios[strategy]:>6.2f}" if ratios[strategy] is not None else f"{'n/a':>6}")
        )
    reasons = {b["name"]: b["reason"] for b in plans["sync"]["baselines"] if not b["feasible"]}
    for name, reason in reasons.items():
        print(f"  {name}: {reason}")

    print()
    verdicts = []
    for strategy, speedup in speedups.items():
        ok = speedup is not None and speedup >= SPEEDUP_TARGET
        verdicts.append(ok)
        what = f"{speedup:.2f}x" if speedup is not None else "not measured (a strategy missed the accuracy)"
        print(
            f"{'PASS' if ok else 'MISS'} {strategy} reaches {args.target_accuracy:.1%} {what} as fast as sync "
            f"(target >= {SPEEDUP_TARGET}x)"
        )
    for strategy, ratio in ratios.items():
        ok = ratio is not None and ratio <= COST_TARGET
        verdicts.append(ok)
        best = plans[strategy]["best"]
        what = f"{ratio:.2f}x the cost of {best['name']} ({1 - ratio:.1%} cheaper)" if ratio is not None else "n/a"
        print(f"{'PASS' if ok else 'MISS'} {strategy}'s elastic plan: {what} (target <= {COST_TARGET}x)")
    print(f"({time.monotonic() - began:.0f} s in all)")
    return 0 if all(verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
