"""Planner benchmark.

    .venv/bin/python bench/planner_bench.py [--blocks 16 32 64] [--time-limit 30] [--samples ...]

1. Solve time of the MILP against the number of blocks x 10 memory tiers x up to 16 stages, on
   seeded synthetic chains shaped like BERT-large (equal layers, 1.3 GB of parameters, Adam),
   one micro-batch size, objective min cost: configurations, model build time, solve time,
   status and proven gap. Target (issue 3): 64 blocks solved to proven optimality in <= 10 s.
2. Per sample (profiled here, 1 timed run): the chosen plan's cost and time as ratios to each
   baseline on the same cost model (< 1 means the plan is better).
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from pathlib import Path

from cloudless.compiler.baselines import baselines
from cloudless.compiler.cost_model import problem_from_chain
from cloudless.compiler.pipeline import FrontEndOptions, run_front_end
from cloudless.compiler.plan import PlanOptions
from cloudless.compiler.planner import solve, stage_configs
from cloudless.ir import Block, BlockChain, MachineInfo
from cloudless.ir.catalog import load_catalog

SAMPLES = Path(__file__).resolve().parent.parent / "samples"


def synthetic_chain(n_blocks: int, seed: int = 0) -> BlockChain:
    """BERT-large-like: 1.3 GB of parameters, ~3 s forward at micro-batch 1 spread over the blocks."""
    rng = random.Random(seed)
    blocks = []
    for i in range(n_blocks):
        jitter = rng.uniform(0.8, 1.2)
        blocks.append(
            Block(
                index=i,
                first=i,
                last=i,
                nodes=[f"n{i}"],
                modules=[f"layer{i}"],
                flops=int(3e9 / n_blocks),
                param_bytes=int(1.34e9 / n_blocks * jitter),
                buffer_bytes=0,
                saved_bytes=int(4e8 / n_blocks * jitter),
                input_bytes=512 * 1024 * 4,
                output_bytes=512 * 1024 * 4,
                params=[],
                forward_s=3.0 / n_blocks * jitter,
                backward_s=5.0 / n_blocks * jitter,
            )
        )
    return BlockChain("synthetic", 1, blocks, {}, MachineInfo(150.0, 2, 2, "bench"), 3)


def solve_time_table(block_counts: list[int], time_limit: float) -> None:
    region = load_catalog().regions[0]
    print(f"MILP solve time: 10 tiers, replicas {{1,2,4,8}}, up to 16 stages, min cost, limit {time_limit:g} s")
    print(f"{'blocks':>6} {'configs':>8} {'total s':>8} {'MILP':>20} {'status':>9} {'gap':>9}")
    for n in block_counts:
        problem = problem_from_chain(
            synthetic_chain(n), region, global_batch=64, micro_batches=(4,), optimizer_state=2, max_stages=16
        )
        configs = len(stage_configs(problem, 4))
        start = time.perf_counter()
        # As cloudless-compile does: the baselines seed the search and prune what cannot beat them.
        incumbents = tuple(b.plan for b in baselines(problem, "cost") if b.plan is not None)
        solution = solve(problem, "cost", time_limit=time_limit, incumbents=incumbents)
        total = time.perf_counter() - start
        gap = "-" if math.isinf(solution.gap) else f"{solution.gap:.2%}"
        print(
            f"{n:>6} {configs:>8} {total:>8.1f} {solution.candidates[4]:>20} {solution.status:>9} {gap:>9}",
            flush=True,
        )


def sample_ratios(samples: list[str], time_limit: float) -> None:
    print("\nPer sample, min cost (then min time): chosen plan / baseline (lower is better)")
    print(
        f"{'sample':<11} {'objective':<6} {'plan s/it':>9} {'plan mUSD/it':>12} {'status':>9} {'gap':>7} "
        f"{'solve s':>7}  baselines (time ratio, cost ratio)"
    )
    for name in samples:
        for objective in ("cost", "time"):
            result = run_front_end(
                FrontEndOptions(
                    SAMPLES / f"{name}.py",
                    profile_repeats=1,
                    plan=PlanOptions(objective=objective, time_limit=time_limit),
                )
            )
            plan = result.plan
            ev = plan.solution.evaluation
            parts = []
            for b in plan.baselines:
                if b.evaluation is None:
                    parts.append(f"{b.name}: cannot fit")
                else:
                    time_ratio, cost_ratio = b.ratios(ev)
                    parts.append(f"{b.name} {time_ratio:.2f}/{cost_ratio:.2f}")
            gap = "?" if plan.solution.gap == float("inf") else f"{plan.solution.gap:.1%}"
            print(
                f"{name:<11} {objective:<6} {ev.iteration_s:>9.2f} {ev.cost_usd * 1e3:>12.4f} "
                f"{plan.solution.status:>9} {gap:>7} {plan.solution.solve_s:>7.1f}  " + "; ".join(parts),
                flush=True,
            )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, nargs="*", default=[16, 32, 64, 128])
    parser.add_argument("--time-limit", type=float, default=30.0)
    parser.add_argument("--samples", nargs="*", default=["mlp_digits", "resnet50", "gpt2", "bert_large"])
    args = parser.parse_args()
    if args.blocks:
        solve_time_table(args.blocks, args.time_limit)
    if args.samples:
        sample_ratios(args.samples, min(args.time_limit, 10.0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
