"""Measure each block's forward and backward time on this machine.

The block chain runs as a pipeline of one-block stages on the example micro-batch: one warm-up run,
then timed runs; after each, a reference fp32 matmul is timed (wall and CPU time) so that the
machine's speed is sampled under the same conditions as the blocks. The reference speed lets later
steps scale block times to a function's share of a CPU.

The statistic is the minimum. On a shared machine a run's time is its cost plus whatever other
processes, interrupts and frequency drops add, and interference only ever adds: the fastest run is
the closest to the cost and the least disturbed, and the median (what earlier versions took) moves
with the load as soon as half the runs are slowed. Each block's time is its fastest run, and the
reference speed is that of the fastest matmul.

A minimum can still be a slowed run when no run was spared, so the profile repeats until stable:
after the requested runs (at least 2), it keeps running while the two fastest totals of the chain
differ by more than STABLE_SHARE, up to MAX_RUNS_FACTOR x the requested runs and EXTRA_BUDGET_S of
extra time. Two runs within 10% of each other are two independent sightings of the floor.

What it records (BlockChain.stability) and warns about (`profile_warnings`):
- `spread`: the gap between the two fastest totals; over UNSTABLE_SHARE (20%, the share by which two
  compiles' predictions may differ) the minimum itself is in doubt: "the profile is unstable".
- `reference_spread`: the same for the reference matmuls.
- `cpu_share`: CPU time the fastest matmul got over its wall time x its threads. A matmul of this size
  keeps every thread computing, so on a machine left to us it is close to 1; below BUSY_SHARE, other
  processes held the cores throughout and every time measured, the fastest included, is too long by
  about 1/share. No repetition fixes that, so the compile says so: "measured on a busy machine".
The compile prints one warning line with every reason (cli.py); a profile reused with --profile
keeps its figures, so its warning is printed again, with the advice to profile again.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch.utils import _pytree as pytree

from ...ir import BlockChain, MachineInfo, OpGraph
from ...ir.blocks import ProfileStability
from ..errors import CompileError, display_path
from .annotate import node_tensors
from .chain import run_chain
from .coarsen import block_cuts
from .split import partition
from .stand_ins import is_stand_in, run_blocks_one_by_one
from .trace import TracedProgram

_R = TypeVar("_R")

#: timed runs even when fewer are asked for: agreement needs two
MIN_RUNS = 2
#: stop repeating once the two fastest runs' totals are within this share of each other
STABLE_SHARE = 0.10
#: warn when, after the last run, they are further apart than this (two compiles may then differ as much)
UNSTABLE_SHARE = 0.20
#: at most this many times the requested runs ...
MAX_RUNS_FACTOR = 3
#: ... and no further run starts once the runs beyond the requested have taken this long (big models)
EXTRA_BUDGET_S = 30.0
#: warn when the fastest reference matmul got less than this share of its threads' CPU time
BUSY_SHARE = 0.8
#: reference matmuls timed after each timed run (and one untimed after the warm-up)
PROBES_PER_RUN = 2
REFERENCE_SIZE = 1024


@dataclass(frozen=True)
class Probe:
    """One timed reference matmul: wall seconds, and CPU seconds of the whole process meanwhile."""

    wall_s: float
    cpu_s: float


@dataclass
class ProfileRuns:
    """Every timed run's per-block times (runs x blocks) and every reference probe."""

    forward_s: list[list[float]]
    backward_s: list[list[float]]
    probes: list[Probe]

    @property
    def totals(self) -> list[float]:
        """Each run's whole forward and backward time."""
        return [sum(f) + sum(b) for f, b in zip(self.forward_s, self.backward_s, strict=True)]


def fastest_gap(samples: Sequence[float]) -> float:
    """Relative gap between the two smallest samples (0 when there are fewer than two): how well
    their minimum is confirmed."""
    if len(samples) < 2:
        return 0.0
    first, second = sorted(samples)[:2]
    return (second - first) / first if first > 0 else 0.0


def max_runs(repeats: int) -> int:
    return max(MAX_RUNS_FACTOR * repeats, MIN_RUNS)


def needs_another_run(totals: Sequence[float], repeats: int, extra_s: float, run_s: float = 0.0) -> bool:
    """The stop rule: whether to time one more run, given each timed run's total so far, the seconds
    already spent on runs beyond the requested ones and how long the last run took (`run_s`): an
    extra run is started only when one like the last fits in what is left of the budget."""
    if len(totals) < max(repeats, MIN_RUNS):
        return True
    if len(totals) >= max_runs(repeats) or extra_s + run_s >= EXTRA_BUDGET_S:
        return False
    return fastest_gap(totals) > STABLE_SHARE


def block_times(runs: Sequence[Sequence[float]]) -> list[float]:
    """Per block (runs x blocks in), the time it is planned with: its fastest run."""
    return [min(column) for column in zip(*runs, strict=True)]


def time_probe(a: torch.Tensor, b: torch.Tensor) -> Probe:
    cpu, wall = time.process_time(), time.perf_counter()
    torch.mm(a, b)
    return Probe(time.perf_counter() - wall, time.process_time() - cpu)


def usable_threads() -> int:
    """torch's threads, or the CPUs this process may run on when fewer (the most it can be given)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, min(torch.get_num_threads(), cpus))


def machine_info(probes: Sequence[Probe], size: int = REFERENCE_SIZE) -> MachineInfo:
    """The machine's fp32 matmul speed: the fastest probe's."""
    best = min(p.wall_s for p in probes)
    return MachineInfo(
        reference_gflops=round(2 * size**3 / best / 1e9, 3),
        threads=torch.get_num_threads(),
        cpu_count=os.cpu_count() or 1,
        torch_version=torch.__version__,
    )


def stability(runs: ProfileRuns, threads: int) -> ProfileStability:
    """How far the runs and the probes agreed, rounded so that blocks.json is stable to print."""
    fastest = min(runs.probes, key=lambda p: p.wall_s)
    share = fastest.cpu_s / (fastest.wall_s * threads) if fastest.wall_s > 0 else 1.0
    return ProfileStability(
        runs=len(runs.forward_s),
        spread=round(fastest_gap(runs.totals), 4),
        reference_spread=round(fastest_gap([p.wall_s for p in runs.probes]), 4),
        cpu_share=round(share, 3),
    )


def repeat_until_stable(
    run_once: Callable[[], tuple[list[float], list[float]]],
    probe: Callable[[], Probe],
    repeats: int,
    clock: Callable[[], float] = time.perf_counter,
) -> ProfileRuns:
    """Time `run_once` (per-block forward and backward seconds) and PROBES_PER_RUN probes after it,
    one warm-up first, until `needs_another_run` says stop. A warm-up longer than the extra budget
    (a big model's, planned from shapes: minutes a run) has warmed what it touches and counts as a run."""
    start = clock()
    warm = run_once()
    probe()
    run_s = clock() - start
    runs = ProfileRuns([], [], [])
    if run_s > EXTRA_BUDGET_S:
        runs.forward_s.append(warm[0])
        runs.backward_s.append(warm[1])
        runs.probes.extend(probe() for _ in range(PROBES_PER_RUN))
    extra_s = 0.0
    while needs_another_run(runs.totals, repeats, extra_s, run_s):
        start = clock()
        forward, backward = run_once()
        runs.forward_s.append(forward)
        runs.backward_s.append(backward)
        runs.probes.extend(probe() for _ in range(PROBES_PER_RUN))
        run_s = clock() - start
        if len(runs.forward_s) > max(repeats, MIN_RUNS):
            extra_s += run_s
    return runs


def measure_runs(
    program: TracedProgram,
    graph: OpGraph,
    chain: BlockChain,
    flat_inputs: list[Any],
    loss_of: Callable[[tuple[Any, ...]], torch.Tensor],
    repeats: int = 3,
    on_run: Callable[[], None] | None = None,
    bf16_mixed: bool = False,
) -> ProfileRuns:
    """Run the chain of one-block stages until stable (`repeat_until_stable`); every timing kept.
    `bf16_mixed`: each block's forward and the loss under CPU autocast to bfloat16, as the
    functions run them under TRAINING["precision"] = "bf16-mixed"."""
    parts = partition(program, graph, block_cuts(chain, [(b.index, b.index) for b in chain.blocks]))
    stages = [_autocast(p.module, bf16_mixed) for p in parts]
    loss_of = _autocast(loss_of, bf16_mixed)
    signatures = [(p.inputs, p.outputs) for p in parts]
    inputs = dict(zip(program.input_names, flat_inputs, strict=True))
    seed = 0

    def run_chained() -> tuple[list[float], list[float]]:
        nonlocal seed
        for p in program.module.parameters():
            p.grad = None
        torch.manual_seed(seed)
        seed += 1
        result = run_chain(stages, signatures, inputs, loss_of)
        times = (list(result.forward_s), list(result.backward_s))
        del result  # its activations and gradients, before the next run allocates its own
        if on_run:
            on_run()
        return times

    held = [[t for n in p.module.graph.nodes for t in node_tensors(p.module, n)] for p in parts]
    keys = block_keys(graph, chain)

    def run_one_by_one() -> tuple[list[float], list[float]]:
        torch.manual_seed(0)
        times = run_blocks_one_by_one(stages, signatures, held, keys, inputs, loss_of)
        if on_run:
            on_run()
        return times

    # planned from shapes (stand-ins for the weights): a block at a time, its weights materialised
    run_once = run_one_by_one if any(is_stand_in(p) for p in program.module.parameters()) else run_chained

    a, b = torch.randn(REFERENCE_SIZE, REFERENCE_SIZE), torch.randn(REFERENCE_SIZE, REFERENCE_SIZE)
    try:
        return repeat_until_stable(run_once, lambda: time_probe(a, b), repeats)
    finally:
        for p in program.module.parameters():
            p.grad = None


def block_keys(graph: OpGraph, chain: BlockChain) -> list[Any]:
    """Per block, what its time follows: its operations, their output shapes and the shapes of the
    parameters they use (identical layers have equal keys; the last block's loss makes it its own)."""
    nodes = {n.name: n for n in graph.nodes}
    keys: list[Any] = []
    for block in chain.blocks:
        key = tuple(
            (
                nodes[name].target,
                tuple((m.shape, m.dtype) for m in nodes[name].outputs),
                tuple((graph.parameters[p].shape, graph.parameters[p].dtype) for p in nodes[name].params),
            )
            for name in block.nodes
        )
        keys.append(key if block.index < len(chain.blocks) - 1 else ("last", key))
    return keys


def _autocast(call: Callable[..., _R], bf16_mixed: bool) -> Callable[..., _R]:
    """`call` run under CPU autocast to bfloat16 when `bf16_mixed` (its backward is not: as a
    training loop's `with torch.autocast(...)` holds the forward and the loss only)."""

    def run(*args: Any) -> _R:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16_mixed):
            return call(*args)

    return run


def profile_blocks(
    program: TracedProgram,
    graph: OpGraph,
    chain: BlockChain,
    flat_inputs: list[Any],
    loss_of: Callable[[tuple[Any, ...]], torch.Tensor],
    repeats: int = 3,
    on_run: Callable[[], None] | None = None,
    bf16_mixed: bool = False,
) -> BlockChain:
    """The chain with measured forward_s/backward_s per block (the fastest run of each), the machine
    info and how stable the measurements were filled in."""
    runs = measure_runs(program, graph, chain, flat_inputs, loss_of, repeats, on_run, bf16_mixed)
    return apply_runs(chain, runs, repeats)


def apply_runs(chain: BlockChain, runs: ProfileRuns, repeats: int) -> BlockChain:
    """Fill the chain from measured runs: block times, machine and stability."""
    for block, f, b in zip(chain.blocks, block_times(runs.forward_s), block_times(runs.backward_s), strict=True):
        block.forward_s = round(f, 6)
        block.backward_s = round(b, 6)
    chain.machine = machine_info(runs.probes)
    chain.profile_repeats = repeats
    chain.stability = stability(runs, usable_threads())
    return chain


def profile_warnings(chain: BlockChain, reused_from: Path | None = None) -> list[str]:
    """The line the compile prints when the chain's times are in doubt, every reason in it (empty
    when stable or not recorded); `reused_from`: the blocks.json the times came from (--profile)."""
    s = chain.stability
    if s is None or chain.machine is None:
        return []
    reasons = []
    if s.spread > UNSTABLE_SHARE:
        reasons.append(f"the two fastest of {s.runs} runs of the model differ by {s.spread:.0%}")
    if s.reference_spread > UNSTABLE_SHARE:
        reasons.append(f"the two fastest reference matmuls differ by {s.reference_spread:.0%}")
    busy = s.cpu_share < BUSY_SHARE
    if busy:
        reasons.append(
            f"the fastest reference matmul ({chain.machine.reference_gflops:.1f} GFLOP/s) got {s.cpu_share:.0%} of "
            f"the CPU time its threads could use, so measured times may be several times this machine's (at least "
            f"{1 / max(s.cpu_share, 0.01):.1f}x; small operations far more: each waits for a thread that is not "
            "running, 20x and more seen)"
        )
    if not reasons:
        return []
    if reused_from is None:
        source = "the profile"
        advice = "Re-run on an idle machine, or reuse a stable profile with --profile BUILD/ir/blocks.json"
    else:
        source = f"the reused profile {display_path(reused_from)}"
        advice = "Profile again on an idle machine (omit --profile)"
    # one line, however many reasons: they share a cause (other processes) and a remedy
    headline = "was measured on a busy machine" if busy else "is unstable"
    return [
        f"{source} {headline}: {'; '.join(reasons)} (other processes running?); plans may follow the noise. {advice}"
    ]


def loss_function(
    out_spec: pytree.TreeSpec, loss_fn: Callable[[Any, Any], torch.Tensor], targets: Any
) -> Callable[[tuple[Any, ...]], torch.Tensor]:
    """The loss of a chain's flat outputs: rebuild the model's output structure, apply loss_fn."""

    def loss_of(flat_outputs: tuple[Any, ...]) -> torch.Tensor:
        return loss_fn(pytree.tree_unflatten(list(flat_outputs), out_spec), targets)

    return loss_of


def reuse_profile(chain: BlockChain, path: Path) -> BlockChain:
    """The chain with the block times and machine of an earlier profile (an ir/blocks.json).

    Measured times differ from run to run; reusing them is what makes two compiles byte-identical.
    The earlier chain must be this model's, cut the same way."""
    try:
        earlier = BlockChain.load(path)
    except (OSError, ValueError) as exc:
        raise CompileError(f"--profile {display_path(path)}: {exc}") from exc
    if earlier.machine is None:
        raise CompileError(f"--profile {display_path(path)}: key machine: the file holds no measured times")
    mismatch = ""
    if (earlier.model, earlier.batch_size) != (chain.model, chain.batch_size):
        mismatch = (
            f"it profiles {earlier.model} at micro-batch {earlier.batch_size}, not {chain.model} at {chain.batch_size}"
        )
    elif len(earlier.blocks) != len(chain.blocks):
        mismatch = f"key blocks: {len(earlier.blocks)} blocks, this model has {len(chain.blocks)}"
    else:
        for before, now in zip(earlier.blocks, chain.blocks, strict=True):
            if before.nodes != now.nodes:
                mismatch = f"key blocks/{now.index}/nodes: the block holds other nodes than this model's"
                break
    if mismatch:
        raise CompileError(f"--profile {display_path(path)}: {mismatch}; profile again (omit --profile)")
    for before, now in zip(earlier.blocks, chain.blocks, strict=True):
        now.forward_s, now.backward_s = before.forward_s, before.backward_s
    chain.machine = earlier.machine
    chain.profile_repeats = earlier.profile_repeats
    # the figures describe the measurement the times come from, so its warnings still apply
    chain.stability = earlier.stability
    return chain
