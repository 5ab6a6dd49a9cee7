"""What bf16 mixed precision saves: bytes between stages per iteration, and predicted time and cost.

    .venv/bin/python bench/precision_bench.py [MODEL.py] [--stages 2] [--replicas 2] [--repeats 3]

The model file (default: samples/llama_text.py) is compiled twice, side by side in one run: as it
is (TRAINING["precision"] = "32-true") and with TRAINING["precision"] = "bf16-mixed". Both are
profiled on this machine (bf16: each block's forward and the loss under CPU autocast) and planned
on the same fixed split (--stages equal-block stages, --replicas each, the largest micro-batch, the
region's largest memory tier), so that the figures differ by the precision alone:

- bytes per iteration: activations and their gradients across the cuts, as the cost model counts
  them, and as measured: the stage's real outputs for one micro-batch, packed for storage as the
  worker packs them (bf16: floating tensors on the wire in bfloat16);
- predicted iteration time and cost of that plan (the cost model), and of the plan the MILP picks;
- forward + backward per micro-batch as profiled here (a CPU without native bf16 may be slower
  in bf16: it is measured, not assumed).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree

from cloudless.compiler.frontend.coarsen import block_cuts
from cloudless.compiler.frontend.split import partition
from cloudless.compiler.pipeline import FrontEnd, FrontEndOptions, run_front_end
from cloudless.compiler.planner.cost_model import CostModel, Plan, StageChoice
from cloudless.compiler.planner.pipeline_milp import solve
from cloudless.compiler.planner.plan import PlanOptions, build_problem
from cloudless.runtimes.storage.tensors import autocast, pack, wire_dtype

SAMPLES = Path(__file__).resolve().parent.parent / "samples"


def with_precision(model: Path, precision: str, folder: Path) -> Path:
    """A copy of the model file whose TRAINING asks for `precision` (the original is not touched)."""
    copy = folder / f"{model.stem}_{precision.replace('-', '_')}.py"
    copy.write_text(model.read_text() + f"\n\nTRAINING = {{**TRAINING, 'precision': {precision!r}}}\n")
    return copy


def measured_cut_bytes(front: FrontEnd, cuts: list[int], precision: str) -> int:
    """Bytes of one micro-batch's activations across `cuts`, as the worker packs them for storage
    (the gradients sent back have the same shapes and dtypes)."""
    parts = partition(front.program, front.graph, cuts)
    values: dict[str, Any] = dict(zip(front.program.input_names, pytree.tree_leaves(front.example_inputs), strict=True))
    total = 0
    with torch.no_grad(), autocast(precision):
        for part in parts[:-1]:
            outputs = part.module(*[values[name] for name in part.inputs])
            sent = dict(zip(part.outputs, outputs, strict=True))
            total += len(pack(sent, wire_dtype(precision)))
            values.update(sent)
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", type=Path, default=SAMPLES / "llama_text.py")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="profiling runs per compile")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(args.model.resolve().parent))  # the model file may import its neighbours
    rows: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as folder:
        for precision in ("32-true", "bf16-mixed"):
            path = with_precision(args.model, precision, Path(folder))
            front = run_front_end(FrontEndOptions(path, profile_repeats=args.repeats))
            options = PlanOptions()
            region, problem = build_problem(front.chain, front.model_file, options)
            micro_batch = max(problem.micro_batches)
            blocks = len(front.chain.blocks)
            bounds = [round(blocks * s / args.stages) for s in range(args.stages + 1)]
            tier = max(region.tiers_mb)
            plan = Plan(
                micro_batch,
                tuple(StageChoice(a, b - 1, tier, args.replicas) for a, b in zip(bounds, bounds[1:], strict=False)),
            )
            evaluation = CostModel(problem).evaluate(plan)
            micro_batches = problem.global_batch // micro_batch
            scale = micro_batch / front.chain.batch_size
            modelled = sum(front.chain.blocks[c.last].output_bytes for c in plan.stages[:-1])
            cuts = block_cuts(front.chain, [(c.first, c.last) for c in plan.stages])
            measured = measured_cut_bytes(front, cuts, precision)
            chosen = solve(problem, time_limit=options.time_limit).plan
            best = CostModel(problem).evaluate(chosen)
            rows[precision] = {
                "modelled_mb": 2 * modelled * scale * micro_batches / 1e6,
                "measured_mb": 2 * measured * scale * micro_batches / 1e6,
                "iteration_s": evaluation.iteration_s,
                "cost_musd": evaluation.cost_usd * 1e3,
                "best_s": best.iteration_s,
                "best_musd": best.cost_usd * 1e3,
                "compute_ms": statistics.fsum(b.forward_s + b.backward_s for b in front.chain.blocks) * 1e3,
            }
    print(
        f"{args.model.name}: {args.stages} stages x {args.replicas} replicas, equal blocks, micro-batch "
        f"{micro_batch} x {micro_batches} per iteration, {tier} MB functions in {region.name}"
    )
    labels = {
        "modelled_mb": "activations + gradients between stages per iteration, cost model (MB)",
        "measured_mb": "the same, packed as the worker sends them (MB)",
        "iteration_s": "predicted iteration time, this split (s)",
        "cost_musd": "predicted cost per iteration, this split (mUSD)",
        "best_s": "predicted iteration time, the MILP's plan (s)",
        "best_musd": "predicted cost per iteration, the MILP's plan (mUSD)",
        "compute_ms": "forward + backward per profiled micro-batch, this machine (ms)",
    }
    print(f"  {'':72} {'32-true':>10} {'bf16-mixed':>10} {'bf16/32':>8}")
    for key, label in labels.items():
        full, mixed = rows["32-true"][key], rows["bf16-mixed"][key]
        print(f"  {label:72} {full:10.4g} {mixed:10.4g} {mixed / full if full else float('nan'):8.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
