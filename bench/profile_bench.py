"""Profile-stability benchmark: the same model profiled and planned in rounds without and with extra
load on the machine, block times taken the old way (median of the requested runs) and the new way
(fastest run, repeated until the two fastest agree), side by side on the same runs.

    .venv/bin/python bench/profile_bench.py [--model tests/models/wide_mlp.py] [--blocks 8] [--hogs 2]

The model is traced once; each round is one `measure_runs` (warm-up, then the new stop rule's runs;
the old statistic reads the first --repeats of them, as the old profile did) while --hogs busy-loop
processes run: none, steadily, or in bursts (busy 0.25 s, asleep 0.25 s). The machine's own load
(other users) is shown as the 1-minute load average.
Both chains are planned (--objective, default time) and the predicted iteration times compared with
the first unloaded round's. Target (issue 16): two compiles' predictions within 20%, or the new
profile warns (compiler/frontend/profile.py: profile_warnings).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils import _pytree as pytree

from cloudless.compiler.frontend.profile import (
    UNSTABLE_SHARE,
    Probe,
    ProfileRuns,
    apply_runs,
    loss_function,
    machine_info,
    measure_runs,
    profile_warnings,
)
from cloudless.compiler.pipeline import FrontEnd, FrontEndOptions, run_front_end
from cloudless.compiler.planner.plan import PlanOptions, plan_training
from cloudless.ir import BlockChain

ROOT = Path(__file__).resolve().parent.parent
HOGS = {
    "steady": "while True:\n    pass\n",
    "bursts": (
        "import time\n"
        "while True:\n"
        "    end = time.monotonic() + 0.25\n"
        "    while time.monotonic() < end:\n"
        "        pass\n"
        "    time.sleep(0.25)\n"
    ),
}
#: the rounds, in order: (name, load)
ROUNDS = [("no load", None), ("steady", "steady"), ("bursts", "bursts"), ("steady", "steady"), ("no load", None)]


@contextmanager
def load(kind: str | None, hogs: int) -> Iterator[None]:
    """`hogs` busy processes for the duration (none when kind is None); each ended by its own id."""
    procs = [subprocess.Popen([sys.executable, "-c", HOGS[kind]]) for _ in range(hogs)] if kind else []
    try:
        if procs:
            time.sleep(0.5)  # the hogs started and spinning before the first timed run
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


@dataclass(frozen=True)
class Round:
    name: str
    #: the chain's whole forward and backward time, old and new statistic
    old_ms: float
    new_ms: float
    #: the plan's predicted iteration time
    old_s: float
    new_s: float
    warned: bool


def old_chain(chain: BlockChain, runs: ProfileRuns, repeats: int) -> BlockChain:
    """The chain as the old profile filled it: each block's median of the first `repeats` timed runs,
    the median of the first 5 reference matmuls, no stability figures."""
    old = copy.deepcopy(chain)
    for i, block in enumerate(old.blocks):
        block.forward_s = round(statistics.median(run[i] for run in runs.forward_s[:repeats]), 6)
        block.backward_s = round(statistics.median(run[i] for run in runs.backward_s[:repeats]), 6)
    old.machine = machine_info([Probe(statistics.median(p.wall_s for p in runs.probes[:5]), 0.0)])
    old.profile_repeats = repeats
    return old


def predicted(front: FrontEnd, chain: BlockChain, options: PlanOptions) -> float:
    return plan_training(chain, front.model_file, options).solution.evaluation.iteration_s


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=ROOT / "tests" / "models" / "wide_mlp.py")
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hogs", type=int, default=2, help="busy-loop processes during a loaded round")
    parser.add_argument("--objective", choices=["cost", "time"], default="time")
    parser.add_argument("--time-limit", type=float, default=5.0)
    args = parser.parse_args()
    front = run_front_end(FrontEndOptions(args.model, num_blocks=args.blocks, profile_repeats=0))
    flat = pytree.tree_leaves(front.example_inputs)
    loss_of = loss_function(front.program.out_spec, front.model_file.loss_fn, front.example_targets)
    options = PlanOptions(objective=args.objective, time_limit=args.time_limit)
    print(
        f"{front.graph.model}: {len(front.chain.blocks)} blocks at micro-batch {front.chain.batch_size}; torch "
        f"{torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs; --repeats {args.repeats}; "
        f"loaded rounds: {args.hogs} busy processes; objective {args.objective}\n"
    )
    header = (
        f"{'round':<8} {'load1':>5} {'runs':>4} {'median ms':>9} {'min ms':>7} {'spread':>6} {'ref':>5} {'cpu':>5} "
        f"{'old s/it':>8} {'new s/it':>8}  warning"
    )
    print(header)
    print("-" * len(header))
    rows = []
    for name, kind in ROUNDS:
        with load(kind, args.hogs):
            runs = measure_runs(front.program, front.graph, front.chain, flat, loss_of, args.repeats)
            load1 = os.getloadavg()[0]
        old = old_chain(front.chain, runs, args.repeats)
        new = apply_runs(copy.deepcopy(front.chain), runs, args.repeats)
        assert new.stability is not None
        warnings = profile_warnings(new)
        row = Round(
            name,
            sum(b.forward_s + b.backward_s for b in old.blocks) * 1e3,
            sum(b.forward_s + b.backward_s for b in new.blocks) * 1e3,
            predicted(front, old, options),
            predicted(front, new, options),
            bool(warnings),
        )
        rows.append(row)
        # the warning's headline: "busy" (the matmul's CPU share) or "unstable" (the spreads)
        verdict = "-" if not warnings else ("busy" if "busy machine" in warnings[0] else "unstable")
        print(
            f"{name:<8} {load1:>5.1f} {new.stability.runs:>4} {row.old_ms:>9.1f} {row.new_ms:>7.1f} "
            f"{new.stability.spread:>6.0%} {new.stability.reference_spread:>5.0%} "
            f"{new.stability.cpu_share:>5.0%} {row.old_s:>8.3f} {row.new_s:>8.3f}  {verdict}",
            flush=True,
        )
    print(
        f"\nPairs of compiles, later / earlier: measured chain time and predicted iteration time, old "
        f"statistic and new; target: predictions within {UNSTABLE_SHARE:.0%}, or the new profile warns"
    )
    print(f"{'pair':<26} {'old ms':>7} {'new ms':>7} {'old s/it':>8} {'new s/it':>8}  new")
    pairs = [(0, i) for i in range(1, len(rows))] + [(1, 3)]
    met = old_met = 0
    for a, b in pairs:
        first, second = rows[a], rows[b]
        old_ratio, new_ratio = second.old_s / first.old_s, second.new_s / first.new_s
        within = abs(new_ratio - 1) <= UNSTABLE_SHARE
        verdict = "within" if within else ("warned" if first.warned or second.warned else "MISSED")
        met += verdict != "MISSED"
        old_met += abs(old_ratio - 1) <= UNSTABLE_SHARE
        label = f"{a + 1}:{first.name} -> {b + 1}:{second.name}"
        print(
            f"{label:<26} {second.old_ms / first.old_ms:>6.2f}x {second.new_ms / first.new_ms:>6.2f}x "
            f"{old_ratio:>7.2f}x {new_ratio:>7.2f}x  {verdict}"
        )
    print(
        f"\nnew profile: {met} of {len(pairs)} pairs within {UNSTABLE_SHARE:.0%} or warned; old (median, never "
        f"warned): {old_met} of {len(pairs)} within {UNSTABLE_SHARE:.0%}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
