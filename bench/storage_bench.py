"""Storage over a run: what a run keeps in storage does not grow with its number of iterations.

Each key has an owner and a lifetime (`cloudless.ir.protocol`'s docstring): a function deletes the
keys it wrote for an iteration two checkpoints later, a stage keeps its last two checkpoints, the
controller deletes each finished range's markers and, at the end, the run's keys (the staged data
stays). This runs `cloudless-run --keep-storage` on two plans of the mlp_digits sample, for N/10
and N iterations, on a folder and on a real Redis, and prints the storage in use: the peak during
the run (sampled every 50 ms), what is left at the end, and after the end-of-run clean-up.

    python bench/storage_bench.py [--iterations 2000] [--quick]

Target: what is left at the end, and the number of keys at any time, do not grow with the
iterations (ratio N vs N/10 about 1). The bound: the staged data, plus per function its keys of at
most 3 x checkpoint_every iterations, plus 3 checkpoints per stage, plus each running invocation's
completion marker (its result: about 0.5 KB per iteration of that invocation, whose length the
function timeout bounds; deleted when its range ends). The peak bytes include those markers.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from cloudless.compiler.build import package_files, write_build
from cloudless.compiler.lower import RegionTraining
from cloudless.compiler.pipeline import FrontEndOptions, lower, run_front_end
from cloudless.compiler.planner.cost_model import Plan, StageChoice
from cloudless.ir.catalog import load_catalog
from cloudless.runtimes.cli import main as cloudless_run
from cloudless.runtimes.storage.channels import open_channel

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "samples" / "mlp_digits.py"

#: (bytes, keys) in use now
Usage = tuple[int, int]


def compile_sample(build: Path) -> None:
    """The sample as `cloudless-compile` plans it (one function on this machine's profile)."""
    subprocess.run(
        [sys.executable, "-m", "cloudless.compiler.cli", str(SAMPLE), "-o", str(build), "-q", "--repeats", "1"],
        check=True,
    )


def write_pipeline(build: Path, iterations: int) -> None:
    """A hand-made plan with every kind of per-iteration key: 2 stages of 2 replicas each
    (activations, gradients, scatter-reduce pieces, reports)."""
    torch.set_num_threads(1)
    front = run_front_end(FrontEndOptions(model_path=SAMPLE, batch_size=8, profile_repeats=0))
    n = len(front.chain.blocks)
    region = load_catalog(None).region(None)
    plan = Plan(8, (StageChoice(0, 0, 1024, 2), StageChoice(1, n - 1, 1024, 2)))
    training = RegionTraining(region, plan, iterations, None)
    lowered = lower(front, [training], None, iterations=iterations, global_batch=64, schedule="gpipe")
    write_build(package_files(lowered), build)


def folder_usage(root: Path) -> Callable[[], Usage]:
    def usage() -> Usage:
        sizes = [p.stat().st_size for p in root.rglob("*") if p.is_file() and not p.name.startswith(".put.")]
        return sum(sizes), len(sizes)

    return usage


def redis_usage(port: int, db: int) -> Callable[[], Usage]:
    import redis

    client = redis.Redis(host="127.0.0.1", port=port, db=db)

    def usage() -> Usage:
        keys = list(client.scan_iter(count=1000))
        return sum(client.strlen(k) for k in keys), len(keys)

    return usage


def start_redis(folder: Path) -> tuple[subprocess.Popen[bytes], int]:
    executable = shutil.which("redis-server")
    if executable is None:
        raise SystemExit("redis-server is not on PATH (bash scripts/system-deps.sh installs it)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [executable, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    process = subprocess.Popen([*command, "--dir", str(folder)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import redis

    client = redis.Redis(host="127.0.0.1", port=port)
    for _ in range(500):
        try:
            client.ping()
            return process, port
        except redis.ConnectionError:
            time.sleep(0.02)
    raise SystemExit("redis-server did not start")


def measured(build: Path, out: Path, storage: str, usage: Callable[[], Usage], iterations: int, run_id: str) -> dict:
    """Run with --keep-storage, sampling storage; then the clean-up a run does without it."""
    peak: Usage = (0, 0)
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.wait(0.05):
            now = usage()
            peak = (max(peak[0], now[0]), max(peak[1], now[1]))

    sampler = threading.Thread(target=sample)
    sampler.start()
    began = time.monotonic()
    try:
        options = ["--iterations", str(iterations), "--storage", storage, "--out", str(out), "--run-id", run_id]
        code = cloudless_run([str(build), *options, "--keep-storage", "-q"])
    finally:
        done.set()
        sampler.join()
    if code != 0:
        raise SystemExit(f"cloudless-run exited {code}")
    end = usage()
    peak = (max(peak[0], end[0]), max(peak[1], end[1]))
    open_channel(storage).delete_prefix(f"{run_id}/")  # what the run does at its end by default
    return {"peak": peak, "end": end, "clean": usage(), "seconds": time.monotonic() - began}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=2000, help="the longer run (the shorter is a tenth)")
    parser.add_argument("--quick", action="store_true", help="the folder and the sample's plan only")
    args = parser.parse_args()
    long_run = args.iterations
    short_run = max(1, long_run // 10)
    work = Path(tempfile.mkdtemp(prefix="cloudless-storage-bench-"))
    builds = {"sample (1x1)": work / "sample"}
    compile_sample(builds["sample (1x1)"])
    if not args.quick:
        builds["pipeline (2 stages x 2)"] = work / "pipeline"
        write_pipeline(builds["pipeline (2 stages x 2)"], 200)
    backends: list[tuple[str, Callable[[Path], tuple[str, Callable[[], Usage]]]]] = [
        ("folder", lambda folder: (str(folder), folder_usage(folder)))
    ]
    redis_server = None
    if not args.quick:
        redis_server, port = start_redis(work)
        database = iter(range(1, 16))

        def on_redis(folder: Path) -> tuple[str, Callable[[], Usage]]:
            db = next(database)  # a database per case: the usage is that case's alone
            return f"redis://127.0.0.1:{port}/{db}", redis_usage(port, db)

        backends.append(("redis", on_redis))
    print(f"torch {torch.__version__}, {os.cpu_count()} cores; {short_run} and {long_run} iterations per case")
    header = f"{'plan':<26}{'storage':<8}{'iterations':>11}{'peak KB':>10}{'peak keys':>10}{'end KB':>9}"
    header += f"{'end keys':>9}{'clean KB':>9}{'s':>7}"
    print(header)
    print("-" * len(header))
    try:
        for label, build in builds.items():
            for backend, make in backends:
                figures = {}
                for iterations in (short_run, long_run):
                    location, usage = make(work / f"{build.name}-{backend}-{iterations}")
                    out = work / f"{build.name}-{backend}-{iterations}-out"
                    figures[iterations] = m = measured(build, out, location, usage, iterations, f"run{iterations}")
                    print(
                        f"{label:<26}{backend:<8}{iterations:>11}{m['peak'][0] / 1e3:>10.0f}{m['peak'][1]:>10}"
                        f"{m['end'][0] / 1e3:>9.0f}{m['end'][1]:>9}{m['clean'][0] / 1e3:>9.0f}{m['seconds']:>7.1f}",
                        flush=True,
                    )
                end = figures[long_run]["end"][0] / max(figures[short_run]["end"][0], 1)
                keys = figures[long_run]["peak"][1] / max(figures[short_run]["peak"][1], 1)
                verdict = "PASS" if end < 1.1 and keys < 1.1 else "MISS"
                print(
                    f"{'':<26}{backend:<8}{long_run} vs {short_run} iterations: end {end:.2f}x, "
                    f"peak keys {keys:.2f}x  {verdict}"
                )
    finally:
        if redis_server is not None:
            redis_server.terminate()
            redis_server.wait()
    print(f"\nbuilds and run outputs under {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
