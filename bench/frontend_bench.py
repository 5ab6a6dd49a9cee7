"""Front-end benchmark: per sample, wall time of trace, annotate and profile, node and block counts,
and our trace+annotate time against a bare torch.export.export of the same model, in the same run.

    .venv/bin/python bench/frontend_bench.py [--samples mlp_digits resnet50 ...] [--repeats 3]

Targets (issue 2): trace+annotate <= 3x bare export; the whole front end for BERT-large <= 60 s.
Times are medians over --repeats runs (export and ours alternate, on the same model instance).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils import _pytree as pytree

from cloudless.compiler.frontend.annotate import annotate
from cloudless.compiler.frontend.coarsen import DEFAULT_BLOCKS, coarsen
from cloudless.compiler.frontend.model_file import load_model_file
from cloudless.compiler.frontend.profile import loss_function, profile_blocks
from cloudless.compiler.frontend.state import preserved_state
from cloudless.compiler.frontend.trace import export_module, trace_model
from cloudless.compiler.pipeline import _default_batch_size

SAMPLES = Path(__file__).resolve().parent.parent / "samples"
ALL = ["mlp_digits", "resnet50", "resnet101", "gpt2", "bert_large"]


def measure(name: str, repeats: int) -> dict[str, float | int | str]:
    path = SAMPLES / f"{name}.py"
    start = time.perf_counter()
    model_file = load_model_file(path)
    batch = _default_batch_size(model_file)
    model, inputs, targets = model_file.instantiate(batch)
    load_s = time.perf_counter() - start
    flat = pytree.tree_leaves(inputs)
    export_s, trace_s, annotate_s = [], [], []
    with preserved_state(model):
        for _ in range(repeats):
            start = time.perf_counter()
            export_module(model, inputs)
            export_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            program = trace_model(model, inputs, model_path=path)
            trace_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            graph = annotate(program, flat, path.name, batch)
            annotate_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        chain = coarsen(graph, DEFAULT_BLOCKS)
        coarsen_s = time.perf_counter() - start
        start = time.perf_counter()
        profile_blocks(program, graph, chain, flat, loss_function(program.out_spec, model_file.loss_fn, targets))
        profile_s = time.perf_counter() - start
    trace_m, annotate_m, export_m = (statistics.median(x) for x in (trace_s, annotate_s, export_s))
    return {
        "sample": name,
        "tracer": program.tracer,
        "batch": batch,
        "nodes": len(graph.nodes),
        "blocks": len(chain.blocks),
        "load_s": load_s,
        "trace_s": trace_m,
        "annotate_s": annotate_m,
        "profile_s": profile_s,
        "export_s": export_m,
        "ratio": (trace_m + annotate_m) / export_m,
        "front_end_s": load_s + trace_m + annotate_m + coarsen_s + profile_s,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", nargs="+", default=ALL, choices=ALL)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; medians of {args.repeats} runs\n")
    header = (
        f"{'sample':<11} {'tracer':<6} {'mb':>3} {'nodes':>6} {'blocks':>6} {'trace s':>8} {'annot s':>8} "
        f"{'profile s':>9} {'export s':>8} {'(t+a)/export':>12} {'front end s':>11}"
    )
    print(header)
    print("-" * len(header))
    rows = []
    for name in args.samples:
        row = measure(name, args.repeats)
        rows.append(row)
        print(
            f"{row['sample']:<11} {row['tracer']:<6} {row['batch']:>3} {row['nodes']:>6} {row['blocks']:>6} "
            f"{row['trace_s']:>8.2f} {row['annotate_s']:>8.2f} {row['profile_s']:>9.2f} {row['export_s']:>8.2f} "
            f"{row['ratio']:>11.2f}x {row['front_end_s']:>11.1f}",
            flush=True,
        )
    print()
    worst = max(rows, key=lambda r: r["ratio"])
    print(
        f"trace+annotate vs bare export: worst {worst['ratio']:.2f}x ({worst['sample']}); target <= 3x: "
        f"{'met' if worst['ratio'] <= 3 else 'MISSED'}"
    )
    bert = next((r for r in rows if r["sample"] == "bert_large"), None)
    if bert:
        print(
            f"BERT-large whole front end (load, trace, annotate, coarsen, profile): {bert['front_end_s']:.1f} s; "
            f"target <= 60 s: {'met' if bert['front_end_s'] <= 60 else 'MISSED'}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
