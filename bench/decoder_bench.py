"""Decoder benchmark: plain PyTorch against `cloudless-run` on samples/llama_text.py (a 0.66M-parameter
transformers Llama, byte-level, 64-token windows, global batch 32), side by side in one run.

The sample is compiled twice: as docs/usage.md does (the default catalog, objective cost), and as
tests/test_llama_sample.py does (a catalog of this machine: 1-vCPU functions, storage a local folder;
objective time, one replica per stage, at most 2 functions: a 2-stage pipeline), the second with the
first's profile, so that both plan on the same measurement. Then, in alternated rounds so that every
configuration sees the machine's moods: plain PyTorch (tests/reference.py: the same samples in the same
order, micro-batches and optimizer, data in memory) and `cloudless-run` of each build (local processes,
storage a folder). Everything runs on one thread per process, as `cloudless-run` gives each function
by default (on a shared machine, torch on every core can be many times slower than on one when other
processes hold the cores). Each figure is the median time per iteration of a measurement, then the
median over rounds; the ratio is the median of the rounds' ratios to plain PyTorch.

    python bench/decoder_bench.py [--iterations 40] [--rounds 5]
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"  # before torch loads: the controller and the plain loop on one thread

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from cloudless.compiler.cli import main as compile_main
from cloudless.compiler.frontend.model_file import load_model_file
from cloudless.ir.files import load_workflow
from cloudless.ir.workflow import Workflow
from cloudless.runtimes.cli import main as cloudless_run

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "samples" / "llama_text.py"
if str(ROOT) not in sys.path:  # the tests' reference trainer and the pipeline's compile options, from a checkout
    sys.path.insert(0, str(ROOT))

from tests.reference import plain_training  # noqa: E402
from tests.test_llama_sample import PIPELINE_OPTIONS, write_local_catalog  # noqa: E402


def compiled(build: Path, *options: str) -> float:
    """Compile the sample into `build`; returns the wall time in seconds."""
    began = time.perf_counter()
    if compile_main([str(SAMPLE), "-o", str(build), "-q", *options]) != 0:
        sys.exit(f"cloudless-compile {' '.join(options)} failed")
    return time.perf_counter() - began


def shape(workflow: Workflow) -> str:
    """`2 stages x (1, 1), micro-batch 8 x 4`"""
    functions = workflow.regions[0].functions
    replicas = ", ".join(str(f.replicas) for f in functions)
    stages = f"{len(functions)} stage{'s' if len(functions) > 1 else ''}"
    return f"{stages} x ({replicas}), micro-batch {workflow.run.micro_batch} x {workflow.run.micro_batches}"


def plain(workflow: Workflow, iterations: int) -> float:
    """Median seconds per iteration of plain PyTorch (the first iteration, which allocates the
    optimizer's state, left out)."""
    times: list[float] = []
    plain_training(
        load_model_file(SAMPLE),
        workflow,
        workflow.regions[0].name,
        iterations,
        lambda _, seconds: times.append(seconds),
    )
    return statistics.median(times[1:])


def cloudless(build: Path, iterations: int) -> dict:
    out = build.parent / f"run-{len(list(build.parent.glob('run-*')))}"
    if cloudless_run([str(build), "--out", str(out), "-q", "--iterations", str(iterations)]) != 0:
        sys.exit(f"cloudless-run failed; see {out}/logs")
    return json.loads((out / "metrics.json").read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=40, help="iterations per measurement (default 40)")
    parser.add_argument("--rounds", type=int, default=5, help="alternated rounds (default 5)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="cloudless-decoder-bench-"))
    cores = os.cpu_count() or 1
    print(
        f"torch {torch.__version__}, {cores} cores; {args.iterations} iterations per measurement, {args.rounds} rounds"
    )

    default = work / "default" / "build"
    pipeline = work / "pipeline" / "build"
    default_s = compiled(default)
    catalog = write_local_catalog(work / "local.yaml")
    profile = default / "ir" / "blocks.json"
    pipeline_s = compiled(pipeline, "--verify", "-c", str(catalog), "--profile", str(profile), *PIPELINE_OPTIONS)
    workflows = {
        "default": load_workflow(default / "workflow.yaml"),
        "pipeline": load_workflow(pipeline / "workflow.yaml"),
    }
    print(f"compile (as docs/usage.md): {default_s:.1f} s, plan {shape(workflows['default'])}")
    print(
        f"compile (--verify, local catalog, {' '.join(PIPELINE_OPTIONS)}, its profile): {pipeline_s:.1f} s, "
        f"plan {shape(workflows['pipeline'])}"
    )
    if workflows["default"].run.global_batch != workflows["pipeline"].run.global_batch:
        sys.exit("the two builds train different global batches")

    rows: dict[str, list[float]] = {}
    final: dict[str, list[float]] = {}
    for round_index in range(args.rounds):
        measured = {"plain PyTorch": plain(workflows["default"], args.iterations)}
        for name, build in (("default", default), ("pipeline", pipeline)):
            metrics = cloudless(build, args.iterations)
            label = f"cloudless-run, {shape(workflows[name]).split(', micro-batch')[0]}"
            measured[label] = metrics["median_iteration_s"]
            final.setdefault(label, []).append(metrics["progress"][-1]["loss"])
        for label, seconds in measured.items():
            rows.setdefault(label, []).append(seconds)
        print(f"round {round_index + 1}: " + ", ".join(f"{label} {s:.3f} s" for label, s in measured.items()))

    batch = workflows["default"].run.global_batch
    print(f"\nmedian s per iteration (global batch {batch}) over {args.rounds} rounds, and the median of the")
    print("rounds' ratios to plain PyTorch (each round's configurations ran back to back)")
    print(f"{'configuration':<42}{'s/iteration':>12}{'vs plain':>10}")
    for label, values in rows.items():
        ratio = statistics.median(v / p for v, p in zip(values, rows["plain PyTorch"], strict=True))
        print(f"{label:<42}{statistics.median(values):>12.3f}{ratio:>9.2f}x")
    for label, losses in final.items():
        print(f"{label}: training loss after {args.iterations} iterations {statistics.median(losses):.3f}")
    print(f"\nbuilds and run outputs (metrics.json, trace.json) under {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
