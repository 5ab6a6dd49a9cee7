"""Measure each block's forward and backward time on this machine.

The block chain runs as a pipeline of one-block stages on the example micro-batch: one warm-up
run, then `repeats` timed runs; each block's time is the median. The machine's reference speed
(fp32 matmul GFLOP/s) is recorded so that later steps can scale block times to a function's share
of a CPU.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree

from cloudless.compiler.chain import run_chain
from cloudless.compiler.coarsen import block_cuts
from cloudless.compiler.errors import CompileError, display_path
from cloudless.compiler.split import partition
from cloudless.compiler.trace import TracedProgram
from cloudless.ir import BlockChain, MachineInfo, OpGraph


def reference_speed(size: int = 1024, repeats: int = 5) -> MachineInfo:
    """Median fp32 matmul speed of this machine with torch's current thread count."""
    a = torch.randn(size, size)
    b = torch.randn(size, size)
    torch.mm(a, b)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - start)
    gflops = 2 * size**3 / statistics.median(times) / 1e9
    return MachineInfo(
        reference_gflops=round(gflops, 3),
        threads=torch.get_num_threads(),
        cpu_count=os.cpu_count() or 1,
        torch_version=torch.__version__,
    )


def profile_blocks(
    program: TracedProgram,
    graph: OpGraph,
    chain: BlockChain,
    flat_inputs: list[Any],
    loss_of: Callable[[tuple[Any, ...]], torch.Tensor],
    repeats: int = 3,
    on_run: Callable[[], None] | None = None,
) -> BlockChain:
    """The chain with measured forward_s/backward_s per block and the machine info filled in."""
    parts = partition(program, graph, block_cuts(chain, [(b.index, b.index) for b in chain.blocks]))
    signatures = [(p.inputs, p.outputs) for p in parts]
    inputs = dict(zip(program.input_names, flat_inputs, strict=True))
    forward: list[list[float]] = [[] for _ in parts]
    backward: list[list[float]] = [[] for _ in parts]
    for run in range(repeats + 1):
        for p in program.module.parameters():
            p.grad = None
        torch.manual_seed(run)
        result = run_chain([p.module for p in parts], signatures, inputs, loss_of)
        if run > 0:  # the first run warms up allocators and kernels
            for i in range(len(parts)):
                forward[i].append(result.forward_s[i])
                backward[i].append(result.backward_s[i])
        del result
        if on_run:
            on_run()
    for p in program.module.parameters():
        p.grad = None
    for block, f, b in zip(chain.blocks, forward, backward, strict=True):
        block.forward_s = round(statistics.median(f), 6)
        block.backward_s = round(statistics.median(b), 6)
    chain.machine = reference_speed()
    chain.profile_repeats = repeats
    return chain


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
            f"it profiles {earlier.model} at micro-batch {earlier.batch_size}, "
            f"not {chain.model} at {chain.batch_size}"
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
    return chain
