"""The schedule of one iteration, shared by the simulator (compiler) and the stage worker (runtime).

The order samples are read in is `sample_order.py`'s.

Micro-batch m runs on replica m mod r of each stage. A replica runs its micro-batches in the order
`compute_order` gives; its stage's gradient is then reduced among the replicas by a pipelined
scatter-reduce in which replica i owns chunk i, and each chunk moves in `sync_pieces` pieces.
"""

from __future__ import annotations

import math

from .workflow import Schedule

# The pipelined scatter-reduce moves each gradient chunk in pieces of about this size (at most
# MAX_SYNC_PIECES), so a replica's uplink and downlink stay busy together.
SYNC_PIECE_BYTES = 4 * 2**20
MAX_SYNC_PIECES = 16
# Requests each direction of a replica keeps going at once in the scatter-reduce, so that a request's
# latency overlaps the transfers before it.
SYNC_IN_FLIGHT = 3
# The scatter-reduce polls for a piece at most this long apart: finding a piece that was just
# written takes (request latency + this) / 2 on average, which the cost model charges each phase.
SYNC_MAX_POLL_S = 0.01


def sync_pieces(
    param_bytes: float, replicas: int, piece_bytes: int = SYNC_PIECE_BYTES, limit: int = MAX_SYNC_PIECES
) -> int:
    """Pieces per chunk in the pipelined scatter-reduce among `replicas` functions."""
    chunk = param_bytes / max(replicas, 1)
    return max(1, min(limit, math.ceil(chunk / piece_bytes)))


def local_micro_batches(micro_batches: int, replicas: int, replica: int) -> list[int]:
    """The micro-batches one replica of a stage runs."""
    return [m for m in range(micro_batches) if m % replicas == replica]


def one_f_one_b_windows(replicas: list[int]) -> list[int]:
    """How far (in micro-batches) each stage's forwards run ahead of its backwards under 1F1B.

    Stage s runs the backward of micro-batch m after the forwards of every m' <= m + w_s. With
    w_s = (S - s) r_s - 1 each replica holds at most S - s micro-batches (S stages); w must not grow
    along the pipeline, or a stage would wait for a forward its predecessor runs only after the
    backward it is itself waiting for."""
    windows: list[int] = []
    for s, r in enumerate(replicas):
        own = (len(replicas) - s) * r - 1
        windows.append(min(own, windows[-1]) if windows else own)
    return windows


def compute_order(schedule: Schedule, local: list[int], window: int) -> list[tuple[str, int]]:
    """The order a replica runs its micro-batches `local`: GPipe does every forward, then every
    backward in reverse; 1F1B runs the backward of m once the forwards up to m + window are done."""
    if schedule == "gpipe":
        return [("forward", m) for m in local] + [("backward", m) for m in reversed(local)]
    keyed = [(m, 0, "forward", m) for m in local] + [(m + window, 1, "backward", m) for m in local]
    return [(kind, m) for _, _, kind, m in sorted(keyed)]


def scatter_order(replica: int, replicas: int) -> list[int]:
    """The staggered order in which a replica sends the pieces of other replicas' chunks:
    (i + d) mod r for d = 1..r-1, so that no two replicas send to the same owner at once. (It
    receives its own chunk's pieces, and then the reduced chunks, in `gather_sources` order.)"""
    return [(replica + d) % replicas for d in range(1, replicas)]


def gather_sources(replica: int, replicas: int) -> list[int]:
    """The replicas whose pieces of its own chunk a replica receives, in arrival order."""
    return [(replica - d) % replicas for d in range(1, replicas)]
