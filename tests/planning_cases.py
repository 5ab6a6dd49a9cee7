"""Seeded random planning problems small enough for exhaustive search."""

from __future__ import annotations

import dataclasses
import random

from cloudless.compiler.planner.cost_model import BlockCost, Plan, Problem, StageChoice
from cloudless.ir.catalog import load_catalog


def random_problem(seed: int) -> Problem:
    rng = random.Random(seed)
    n_blocks = rng.randint(1, 5)
    base = load_catalog().regions[0]
    tiers = tuple(sorted(rng.sample([1024, 2048, 3008, 4096, 6144, 10240], rng.randint(1, 3))))
    region = dataclasses.replace(
        base,
        tiers_mb=tiers,
        runtime_overhead_mb=rng.choice([100, 400]),
        request_latency_s=rng.choice([0.0, 0.02]),
        min_mb_per_s=rng.choice([20, 50]),
        max_mb_per_s=rng.choice([60, 90]),
    )
    blocks = []
    previous = rng.randint(10**4, 10**7)
    for _ in range(n_blocks):
        out = rng.randint(10**4, 3 * 10**7)
        blocks.append(
            BlockCost(
                forward_s=rng.uniform(0.001, 0.5),
                backward_s=rng.uniform(0.002, 1.0),
                param_bytes=rng.randint(10**5, 8 * 10**8),
                buffer_bytes=rng.randint(0, 10**4),
                saved_bytes=rng.randint(10**5, 5 * 10**8),
                input_bytes=previous,
                output_bytes=out,
            )
        )
        previous = out
    shared: dict[str, int] = {}
    if n_blocks >= 2 and rng.random() < 0.5:
        shared = {"tied": rng.randint(10**6, 10**8)}
        blocks[0] = dataclasses.replace(blocks[0], shared=("tied",))
        blocks[-1] = dataclasses.replace(blocks[-1], shared=("tied",))
    return Problem(
        blocks=tuple(blocks),
        shared_bytes=shared,
        profile_batch=rng.choice([1, 2, 4]),
        reference_gflops=rng.uniform(50, 200),
        threads=2,
        region=region,
        global_batch=rng.choice([8, 16, 32]),
        micro_batches=tuple(rng.sample([1, 2, 4, 8], 2)),
        replicas=tuple(sorted(rng.sample([1, 2, 3, 4], 2))),
        max_stages=rng.randint(1, 4),
        max_functions=rng.choice([None, 4, 8]),
        schedule=rng.choice(["gpipe", "1f1b"]),
        optimizer_state=rng.choice([0, 1, 2]),
        iterations=10,
    )


def random_plan(problem: Problem, rng: random.Random) -> Plan:
    """Any plan of the problem: micro-batch size, contiguous stages, tier and replicas per stage."""
    mu = rng.choice(sorted(problem.micro_batch_counts()))
    n_blocks = len(problem.blocks)
    n_stages = rng.randint(1, min(n_blocks, problem.max_stages))
    cuts = sorted(rng.sample(range(1, n_blocks), n_stages - 1))
    starts, ends = [0, *cuts], [*(c - 1 for c in cuts), n_blocks - 1]
    return Plan(
        mu,
        tuple(
            StageChoice(a, b, rng.choice(problem.region.tiers_mb), rng.choice(problem.replicas))
            for a, b in zip(starts, ends, strict=True)
        ),
    )
