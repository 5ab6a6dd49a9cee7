"""Gradient-sync benchmark: the pipelined scatter-reduce against its bandwidth bound.

    python bench/sync_bench.py [--mib 128] [--mb-per-s 90] [--latency 0.02] [--replicas 2 4 8] [--repeats 3]

For n replicas, each a separate process (spawn) with its own emulated link to storage (an
`EmulatedChannel` of B bytes per second each way and a per-request latency, over one shared
`DirectoryChannel` in a temporary folder), every replica calls `scatter_reduce` on its own P bytes
of float32 gradient; they start together at a barrier, and a run takes as long as the slowest
replica from the barrier to its return. The bound is a downlink that never idles:
2 (n-1)/n P / B (each replica receives its own chunk from every other replica, then every other
reduced chunk). Printed per n: the median over the repeats of the pipelined and of the sequential
variant, their share of the bound's speed (bound / measured), and what the cost model predicts.
Target: the pipelined variant at >= 85% of the bound's speed for every n.

Defaults follow the default catalog: B is its `max_mb_per_s` (megabytes/s, as `Region.bandwidth_bps` reads it;
the fastest link is where per-request latency weighs most), the latency its `request_latency_s`;
P = 128 MiB is a BERT-base-sized stage. Pieces are the runtime's (schedule.SYNC_PIECE_BYTES): the
downlink cannot start before a first piece has been uploaded, so the bound is out of reach by about
one piece and two request latencies (the cost model counts them); the smaller P, the more that
weighs. All replica processes share this machine's cores, which n functions would not.
Every replica's result is checked against the exact sum (the gradients are small dyadic numbers,
so the sum is exact in float32) and to be bit-identical on every replica.
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cloudless.compiler.planner.cost_model import CostModel, Problem
from cloudless.ir.catalog import load_catalog
from cloudless.ir.schedule import MAX_SYNC_PIECES, SYNC_PIECE_BYTES, sync_pieces
from cloudless.runtimes.function.scatter_reduce import scatter_reduce
from cloudless.runtimes.storage.channels import DirectoryChannel
from cloudless.runtimes.storage.emulation import EmulatedChannel, Resources

TARGET = 0.85
BLOCK = 2**20
EXPECTED = "expected.f32"
VARIANTS = (("pipelined", True), ("sequential", False))


def gradient(replica: int, numel: int) -> torch.Tensor:
    """Replica `replica`'s gradient: multiples of 2^-6 below 2^7 in magnitude, so sums of a few are exact.
    A random block of 2^20 values, shifted by a different whole number in each repetition (cheap to make)."""
    generator = torch.Generator().manual_seed(1000 + replica)
    block = torch.randint(-(2**12), 2**12, (BLOCK,), generator=generator).to(torch.float32) / 2**6
    blocks = -(-numel // BLOCK)
    shifts = (torch.arange(blocks, dtype=torch.float32) * 7 + replica * 13) % 61 - 30
    return (block.view(1, BLOCK) + shifts.view(blocks, 1)).view(-1)[:numel].clone()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.int32), b.view(torch.int32))


def replica_main(
    replica: int,
    replicas: int,
    numel: int,
    root: str,
    resources: Resources,
    repeats: int,
    barrier: Any,
    results: Any,
) -> None:
    torch.set_num_threads(1)  # n processes share this machine's cores (n functions would not)
    flat = gradient(replica, numel)
    expected = torch.from_numpy(np.fromfile(Path(root) / EXPECTED, dtype=np.float32))
    channel = EmulatedChannel(DirectoryChannel(Path(root) / "storage"), resources)
    options = {"piece_bytes": SYNC_PIECE_BYTES, "max_pieces": MAX_SYNC_PIECES}
    # Warm-up (untimed): thread pools, safetensors, the file system paths, on a small tensor.
    barrier.wait()
    scatter_reduce(channel, "warmup", flat[: 1 << 16], replica, replicas, **options)
    for repeat in range(repeats):
        for name, pipelined in VARIANTS:
            key = f"r{repeat}-{name}"
            barrier.wait()
            began = time.monotonic()
            total = scatter_reduce(channel, key, flat, replica, replicas, pipelined=pipelined, **options)
            took = time.monotonic() - began
            results.put((repeat, name, replica, took, same_bits(total, expected)))
            del total
            barrier.wait()  # everyone has read everything: clear the run's keys before the next
            if replica == 0:
                shutil.rmtree(channel.inner.root / key, ignore_errors=True)
    barrier.wait()


def run(replicas: int, numel: int, resources: Resources, repeats: int, folder: str | None) -> dict[str, list[float]]:
    """Per variant, the slowest replica's time of each repeat; asserts every result is the exact sum."""
    context = mp.get_context("spawn")
    barrier = context.Barrier(replicas)
    results = context.Queue()
    with tempfile.TemporaryDirectory(prefix="sync-bench-", dir=folder) as root:
        expected = gradient(0, numel)
        for j in range(1, replicas):
            expected += gradient(j, numel)
        expected.numpy().tofile(Path(root) / EXPECTED)
        del expected
        processes = [
            context.Process(target=replica_main, args=(j, replicas, numel, root, resources, repeats, barrier, results))
            for j in range(replicas)
        ]
        for process in processes:
            process.start()
        times: dict[tuple[int, str], list[float]] = {}
        for _ in range(replicas * repeats * len(VARIANTS)):
            repeat, name, replica, took, exact = results.get(timeout=900)
            assert exact, f"n={replicas} {name} repeat {repeat}: replica {replica} did not get the exact sum"
            times.setdefault((repeat, name), []).append(took)
        for process in processes:
            process.join(timeout=60)
            assert process.exitcode == 0, f"replica process exited with {process.exitcode}"
    return {name: [max(times[(repeat, name)]) for repeat in range(repeats)] for name, _ in VARIANTS}


def predicted(param_bytes: int, replicas: int, bytes_per_s: float, latency_s: float) -> float:
    """CostModel.sync_time for a region whose every tier has this bandwidth and latency."""
    region = dataclasses.replace(
        load_catalog().regions[0],
        min_mb_per_s=bytes_per_s / 1e6,
        max_mb_per_s=bytes_per_s / 1e6,
        request_latency_s=latency_s,
    )
    problem = Problem(
        blocks=(),
        shared_bytes={},
        profile_batch=1,
        reference_gflops=1.0,
        threads=1,
        region=region,
        global_batch=1,
        micro_batches=(1,),
    )
    return CostModel(problem).sync_time(param_bytes, replicas, region.tiers_mb[-1])


def main(argv: list[str] | None = None) -> int:
    region = load_catalog().regions[0]
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=float, default=128.0, help="gradient size P in MiB of float32 (default 128)")
    parser.add_argument(
        "--mb-per-s",
        type=float,
        default=region.max_mb_per_s,
        help=f"per-function bandwidth B each way, megabytes/s (default {region.max_mb_per_s:g}: the catalog's "
        "max_mb_per_s)",
    )
    parser.add_argument(
        "--latency",
        type=float,
        default=region.request_latency_s,
        help=f"per-request latency, s (default {region.request_latency_s:g}: the catalog's request_latency_s)",
    )
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--dir",
        default="/dev/shm" if Path("/dev/shm").is_dir() else None,
        help="where the shared storage folder goes (default /dev/shm: keeps the emulated storage's own cost low)",
    )
    args = parser.parse_args(argv)

    numel = int(args.mib * 2**20) // 4
    param_bytes = numel * 4
    bandwidth = args.mb_per_s * 1e6
    resources = Resources(bytes_per_s=bandwidth, latency_s=args.latency)
    print(
        f"P = {param_bytes / 2**20:g} MiB float32, B = {args.mb_per_s:g} MB/s each way, latency {args.latency:g} s, "
        f"pieces of <= {SYNC_PIECE_BYTES / 2**20:g} MiB (at most {MAX_SYNC_PIECES} per chunk), "
        f"median of {args.repeats}, slowest replica per run; {os.cpu_count()} cores for all replica processes"
    )
    header = (
        f"{'n':>2} {'pieces':>6} {'bound s':>8} {'model s':>8} {'pipelined s':>11} {'share':>6} "
        f"{'sequential s':>12} {'share':>6}"
    )
    print(header)
    print("-" * len(header))
    verdicts = []
    began = time.monotonic()
    for n in args.replicas:
        bound = 2 * (n - 1) / n * param_bytes / bandwidth
        model = predicted(param_bytes, n, bandwidth, args.latency)
        times = run(n, numel, resources, args.repeats, args.dir)
        pipelined = statistics.median(times["pipelined"])
        sequential = statistics.median(times["sequential"])
        print(
            f"{n:>2} {sync_pieces(param_bytes, n):>6} {bound:>8.3f} {model:>8.3f} {pipelined:>11.3f} "
            f"{bound / pipelined:>6.1%} {sequential:>12.3f} {bound / sequential:>6.1%}",
            flush=True,
        )
        verdicts.append((n, bound / pipelined))
    print(f"(all results exact and bit-identical on every replica; {time.monotonic() - began:.0f} s in all)")
    for n, share in verdicts:
        verdict = "PASS" if share >= TARGET else "MISS"
        print(f"{verdict} n={n}: pipelined at {share:.1%} of the bound's speed (target {TARGET:.0%})")
    return 0 if all(share >= TARGET for _, share in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
