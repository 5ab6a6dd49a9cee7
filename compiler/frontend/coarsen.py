"""Coarsen the op graph into a chain of blocks at cut points of its topological order.

Positions are the compute nodes (call_function, call_method, call_module) in execution order.
Cutting after position p splits the graph in two; every value defined at or before p and used
after it crosses the cut (skip connections and model inputs included). Parameters do not cross:
each stage reads its own copy.

A cut is valid when every crossing value is a single tensor (what storage carries) and none of
them is mutated in place after the cut. Blocks are balanced by estimated cost (FLOPs plus a
memory-traffic term, since elementwise ops count 0 FLOPs), and each cut is placed, within a
window around its balanced position, where the fewest bytes cross.

A block holds at most MAX_BLOCK_PARAM_BYTES of parameters where the graph can be cut that finely.
When balanced blocks would hold more (a 70B model's 30 blocks hold 2.7 of its 3.4 GB layers each),
the model is cut again, block by block, at the ends of its repeated structures (a transformer's layers,
`model.layers.3`: `bounded_cuts`): each block as many whole layers as the bound and its share of the
cost allow, so that identical layers make identical blocks (the profile times one for all).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ...ir import Block, BlockChain, OpGraph, OpNode

COMPUTE_OPS = ("call_function", "call_method", "call_module")
#: FLOPs charged per output byte: elementwise ops are memory-bound, about 10 FLOP-times per byte
#: on a CPU doing ~50 GFLOP/s matmul with ~5 GB/s of effective memory bandwidth.
FLOPS_PER_BYTE = 10
#: How far from its balanced position a cut may move to find fewer crossing bytes (fraction of a block).
WINDOW = 0.3
DEFAULT_BLOCKS = 30
#: the most bytes of parameters (and buffers) a block holds, where the graph allows. A function holds
#: its blocks' weights and their gradients: a block past 4 GiB (8 GiB with its gradients) would fill
#: most of the largest function (Lambda's 10,240 MB) alone; and the profile of a model planned from
#: shapes makes a block's weights and gradients at once, so its memory follows this bound, not the
#: model's size. Far above a small model's blocks (a 1.1B's are ~0.2 GB): their cuts never change.
MAX_BLOCK_PARAM_BYTES = 4 << 30


@dataclass(frozen=True)
class Liveness:
    """Per position: the values live across the cut after it, and whether that cut is valid."""

    positions: list[OpNode]
    crossing_bytes: list[int]
    valid: list[bool]
    input_bytes: int
    output_bytes: int


def compute_positions(graph: OpGraph) -> list[OpNode]:
    return [n for n in graph.nodes if n.op in COMPUTE_OPS]


def crossing_values(graph: OpGraph, cuts: list[int]) -> list[list[str]]:
    """For each cut position, the names of the values live across it, in definition order."""
    positions = compute_positions(graph)
    define, last_use = _def_use(graph, positions)
    order = [n.name for n in graph.nodes if n.name in define]
    return [[v for v in order if define[v] <= cut < last_use[v]] for cut in cuts]


def _def_use(graph: OpGraph, positions: list[OpNode]) -> tuple[dict[str, int], dict[str, int]]:
    index = {n.name: i for i, n in enumerate(positions)}
    end = len(positions)
    define: dict[str, int] = {n: -1 for n in graph.inputs}
    define.update(index)
    last_use: dict[str, int] = dict.fromkeys(define, -1)
    for node in graph.nodes:
        user_position = end if node.op == "output" else index.get(node.name)
        if user_position is None:
            continue
        for source in node.inputs:
            if source in define:
                last_use[source] = max(last_use[source], user_position)
    return define, last_use


def sent_bytes(node: OpNode, narrow: bool) -> int:
    """The bytes of `node`'s value as a stage sends it: as traced, or, with `narrow` (bf16-mixed
    precision), each floating tensor in bfloat16 (2 bytes per element: those autocast makes bf16
    and the float32 ones rounded to it on the way)."""
    if not narrow or not node.outputs:
        return node.output_bytes
    total = 0
    for meta in node.outputs:
        dtype = getattr(torch, meta.dtype, None)
        itemsize = dtype.itemsize if isinstance(dtype, torch.dtype) else 0
        if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
            itemsize = min(itemsize, 2)
        total += math.prod(meta.shape) * itemsize
    return total


def liveness(graph: OpGraph, narrow: bool = False) -> Liveness:
    """Values live across each cut and their bytes as sent (`narrow`: floating ones in bf16)."""
    positions = compute_positions(graph)
    by_name = {n.name: n for n in graph.nodes}
    define, last_use = _def_use(graph, positions)
    n = len(positions)
    # Difference arrays: value v adds its bytes to cuts define[v] .. last_use[v]-1.
    delta = [0] * (n + 2)
    bad = [0] * (n + 2)
    for name, start in define.items():
        stop = last_use[name]
        if stop <= start:
            continue
        node = by_name[name]
        size = sent_bytes(node, narrow)
        delta[start + 1] += size
        delta[stop + 1] -= size
        if node.value != "tensor":
            bad[start + 1] += 1
            bad[stop + 1] -= 1
    # A value mutated at position q must not cross any cut before q.
    for q, node in enumerate(positions):
        for mutated in node.mutates:
            if mutated in define:
                bad[define[mutated] + 1] += 1
                bad[q + 1] -= 1
    crossing, valid = [], []
    running, invalid = delta[0], bad[0]  # model inputs (defined at -1) start at index 0
    for p in range(n):
        running += delta[p + 1]
        invalid += bad[p + 1]
        crossing.append(running)
        valid.append(invalid == 0 and p < n - 1)
    # the first stage reads the model's inputs from the staged data, as stored: never narrowed
    input_bytes = sum(by_name[v].output_bytes for v in graph.inputs if last_use.get(v, -1) >= 0)
    output_bytes = sum(sent_bytes(by_name[v], narrow) for v in graph.outputs if v in by_name)
    return Liveness(positions, crossing, valid, input_bytes, output_bytes)


def node_cost(node: OpNode) -> int:
    return node.flops + FLOPS_PER_BYTE * node.output_bytes


def balancing_costs(costs: list[int], num_blocks: int) -> list[int]:
    """Costs with each node clamped to one block's share, so that a node bigger than a block (an
    LM head) takes one block and the others spread over the rest instead of vanishing into it."""
    clamped = [max(c, 1) for c in costs]
    for _ in range(8):
        share = sum(clamped) // max(num_blocks, 1)
        limited = [min(c, max(share, 1)) for c in clamped]
        if limited == clamped:
            break
        clamped = limited
    return clamped


def choose_cuts(live: Liveness, num_blocks: int) -> list[int]:
    """Cut positions (a block ends at each) for about `num_blocks` balanced, cheap-to-cut blocks."""
    costs = balancing_costs([node_cost(node) for node in live.positions], num_blocks)
    cumulative, total = [], 0
    for c in costs:
        total += c
        cumulative.append(total)
    valid = [p for p, ok in enumerate(live.valid) if ok]
    cuts: list[int] = []
    for j in range(1, num_blocks):
        target = total * j / num_blocks
        half = WINDOW * total / num_blocks
        previous = cuts[-1] if cuts else -1
        later = [p for p in valid if p > previous]
        if not later:
            break
        window = [p for p in later if target - half <= cumulative[p] <= target + half]
        if window:
            best = min(window, key=lambda p: (live.crossing_bytes[p], abs(cumulative[p] - target), p))
        else:
            best = min(later, key=lambda p: (abs(cumulative[p] - target), p))
        if cuts and best == cuts[-1]:
            continue
        cuts.append(best)
    return cuts


def repeated_unit(module: str) -> str:
    """The instance of a repeated structure a module path lies in: the path up to its first numbered
    part ("model.layers.3" for "model.layers.3.mlp.up_proj", "3" in a Sequential), else the path."""
    parts = module.split(".")
    numbered = next((i for i, part in enumerate(parts) if part.isdigit()), None)
    return module if numbered is None else ".".join(parts[: numbered + 1])


def position_params(graph: OpGraph, positions: Sequence[OpNode]) -> list[list[str]]:
    """Per position, the parameters and buffers it reads: its own (call_module) and through get_attr."""
    by_name = {n.name: n for n in graph.nodes}
    read: list[list[str]] = []
    for node in positions:
        readers = [node] + [by_name[i] for i in node.inputs if by_name[i].op == "get_attr"]
        read.append(list(dict.fromkeys(name for reader in readers for name in reader.params)))
    return read


def held_bytes(graph: OpGraph, params_at: Sequence[Sequence[str]], bounds: Sequence[tuple[int, int]]) -> list[int]:
    """Per block (cut before, last position), the bytes of the parameters and buffers it reads."""
    return [
        sum(graph.parameters[name].bytes for name in dict.fromkeys(n for p in params_at[b + 1 : e + 1] for n in p))
        for b, e in bounds
    ]


def bounded_cuts(
    live: Liveness, graph: OpGraph, params_at: Sequence[Sequence[str]], num_blocks: int, max_bytes: int
) -> list[int]:
    """Cuts for blocks of at most `max_bytes` of parameters, left to right, each block ending at the
    farthest cut within the bound and its cost share (1 + WINDOW times a balanced block's): at the end
    of a repeated structure (`repeated_unit`) where one fits, else at any valid cut (a layer bigger than
    the bound or the share is cut inside), else at the first valid cut (an operation bigger than the
    bound on its own)."""
    positions = live.positions
    costs = balancing_costs([node_cost(node) for node in positions], num_blocks)
    share = sum(costs) / max(num_blocks, 1) * (1 + WINDOW)
    units = [repeated_unit(node.module) for node in positions]
    sizes = {name: info.bytes for name, info in graph.parameters.items()}
    cuts: list[int] = []
    start = 0
    while True:
        held: set[str] = set()
        nbytes = cost = 0
        first = at_unit_end = anywhere = None
        for p in range(start, len(positions)):
            for name in params_at[p]:
                if name not in held:
                    held.add(name)
                    nbytes += sizes[name]
            cost += costs[p]
            within = nbytes <= max_bytes and cost <= share
            if p == len(positions) - 1 and within:
                return cuts  # the rest is one block
            if not live.valid[p]:  # the last position is never a valid cut
                continue
            first = p if first is None else first
            if not within:
                break
            anywhere = p
            if units[p] != units[p + 1]:
                at_unit_end = p
        cut = at_unit_end if at_unit_end is not None else anywhere if anywhere is not None else first
        if cut is None:
            return cuts
        cuts.append(cut)
        start = cut + 1


def coarsen(
    graph: OpGraph, num_blocks: int = DEFAULT_BLOCKS, narrow: bool = False, max_bytes: int = MAX_BLOCK_PARAM_BYTES
) -> BlockChain:
    """The block chain (times still zero: profiling fills them in); its blocks' input and output
    bytes are those sent across the cuts (`narrow`: bf16-mixed, floating values in bf16). Blocks hold
    at most `max_bytes` of parameters where the graph can be cut that finely (`bounded_cuts`)."""
    live = liveness(graph, narrow)
    if not live.positions:
        raise ValueError("the traced graph has no operations")
    params_at = position_params(graph, live.positions)
    last_position = len(live.positions) - 1
    cuts = choose_cuts(live, max(1, num_blocks))
    bounds = list(zip([-1, *cuts], [*cuts, last_position], strict=True))
    if max(held_bytes(graph, params_at, bounds)) > max_bytes:
        cuts = bounded_cuts(live, graph, params_at, max(1, num_blocks), max_bytes)
        bounds = list(zip([-1, *cuts], [*cuts, last_position], strict=True))
    users_of_param: dict[str, set[int]] = {}
    blocks: list[Block] = []
    for index, (before, last) in enumerate(bounds):
        members = live.positions[before + 1 : last + 1]
        params = list(dict.fromkeys(name for p in params_at[before + 1 : last + 1] for name in p))
        for name in params:
            users_of_param.setdefault(name, set()).add(index)
        modules: list[str] = []
        for node in members:
            if node.module and node.module not in modules:
                modules.append(node.module)
        blocks.append(
            Block(
                index=index,
                first=before + 1,
                last=last,
                nodes=[n.name for n in members],
                modules=modules,
                flops=sum(n.flops for n in members),
                param_bytes=sum(graph.parameters[p].bytes for p in params if graph.parameters[p].trainable),
                buffer_bytes=sum(graph.parameters[p].bytes for p in params if not graph.parameters[p].trainable),
                saved_bytes=sum(n.saved_bytes for n in members),
                input_bytes=live.input_bytes if before < 0 else live.crossing_bytes[before],
                output_bytes=live.output_bytes if last == last_position else live.crossing_bytes[last],
                params=params,
            )
        )
    shared = {name: graph.parameters[name].bytes for name, users in users_of_param.items() if len(users) > 1}
    return BlockChain(
        model=graph.model,
        batch_size=graph.batch_size,
        blocks=blocks,
        shared_params=dict(sorted(shared.items())),
        sequenced=[name for name, rule in graph.buffer_rules.items() if rule.rule == "sequence"],
    )


def block_cuts(chain: BlockChain, stage_ranges: list[tuple[int, int]]) -> list[int]:
    """Position cuts for a contiguous assignment of blocks to stages, given as (first, last) blocks."""
    expected = 0
    for first, last in stage_ranges:
        if first != expected or last < first or last >= len(chain.blocks):
            raise ValueError(f"stage ranges {stage_ranges} are not a contiguous cover of {len(chain.blocks)} blocks")
        expected = last + 1
    if expected != len(chain.blocks):
        raise ValueError(f"stage ranges {stage_ranges} do not cover all {len(chain.blocks)} blocks")
    return [chain.blocks[last].last for _, last in stage_ranges[:-1]]


def balanced_ranges(weights: Sequence[float], stages: int) -> list[tuple[int, int]]:
    """Contiguous ranges whose weight sums are about total/stages each (cut where the running sum
    passes each share), every range non-empty."""
    total = sum(weights) or 1.0
    ranges: list[tuple[int, int]] = []
    first, running = 0, 0.0
    for i, weight in enumerate(weights):
        running += weight
        left_blocks = len(weights) - i - 1
        left_stages = stages - len(ranges) - 1
        if left_stages == 0:
            break
        if running >= total * (len(ranges) + 1) / stages or left_blocks == left_stages:
            ranges.append((first, i))
            first = i + 1
    ranges.append((first, len(weights) - 1))
    return ranges
