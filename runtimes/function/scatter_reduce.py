"""Gradient synchronisation among the replicas of a stage through storage.

The pipelined scatter-reduce (FuncPipe): replica i owns chunk i of the flat gradient. It uploads
every other chunk piece by piece, round by round (round p: piece p of each chunk, in the staggered
order of `scatter_order`, so that no two replicas send to the same owner at once), while it
downloads the pieces of its own chunk in the same rounds and reduces each piece as soon as every
replica's copy has arrived, then uploads the reduced piece; last it downloads the reduced chunks of
the others. The sequential variant finishes each phase before the next starts, for comparison.

Each direction keeps up to `in_flight` requests going at once (a function's uplink and downlink
run together, and each request's latency overlaps the transfers before it on its link instead of
adding to them): uploads go to a small pool of uplink threads, and downloads are prefetched in the
order they are needed by a small pool of downlink threads, at most `in_flight` ahead, so memory
stays bounded. A download whose key is not there yet polls with bounded back-off (sleeping).

Each reduced chunk is computed once, by its owner, summing in replica order, so every replica ends
with bit-identical gradients (equal to the plain sum in replica order).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ...ir.protocol import reduced_piece_key, scatter_piece_key
from ...ir.schedule import SYNC_IN_FLIGHT, SYNC_MAX_POLL_S, gather_sources, scatter_order, sync_pieces
from ..storage.channels import Channel, KeyTimeout
from ..storage.polling import Backoff
from ..storage.tensors import pack, unpack


class _Cancelled(Exception):
    """The scatter-reduce failed elsewhere; a pending download gives up."""


class _Prefetch:
    """Tensors at `names`, downloaded in order with up to `ahead` requests in flight."""

    def __init__(
        self, pool: ThreadPoolExecutor, fetch: Callable[[str], torch.Tensor], names: Iterable[str], ahead: int
    ) -> None:
        self._pool, self._fetch, self._names = pool, fetch, iter(names)
        self._pending: deque[Future[torch.Tensor]] = deque()
        for _ in range(ahead):
            self._submit()

    def _submit(self) -> None:
        name = next(self._names, None)
        if name is not None:
            self._pending.append(self._pool.submit(self._fetch, name))

    def __iter__(self) -> Iterator[torch.Tensor]:
        while self._pending:
            future = self._pending.popleft()
            self._submit()  # queued behind the ones in flight: starts as soon as one of them is done
            yield future.result()


def scatter_reduce(
    channel: Channel,
    key: str,
    flat: torch.Tensor,
    replica: int,
    replicas: int,
    *,
    piece_bytes: int,
    max_pieces: int,
    pipelined: bool = True,
    timeout: float = 600.0,
    in_flight: int = SYNC_IN_FLIGHT,
    abort: Callable[[], None] | None = None,
) -> torch.Tensor:
    """The sum of `flat` over the stage's replicas (every replica calls this with its own); its
    pieces go under `key` (`protocol.sync_key`). `abort`, called about once a second while a piece
    is awaited, raises to give up."""
    if replicas == 1:
        return flat
    pieces = sync_pieces(flat.numel() * flat.element_size(), replicas, piece_bytes, max_pieces)
    chunks = [list(torch.tensor_split(chunk, pieces)) for chunk in torch.tensor_split(flat, replicas)]
    sources = gather_sources(replica, replicas)
    stopped = threading.Event()
    max_poll_s = min(channel.max_poll_s, SYNC_MAX_POLL_S)

    def receive(name: str) -> torch.Tensor:
        clock = Backoff(channel.poll_s, max_poll_s, timeout, stopped)
        while True:
            data = channel.try_get(name)
            if data is not None:
                return unpack(data)["v"]
            if clock.expired():
                raise KeyTimeout(f"{channel.describe(name)} did not appear within {timeout:g} s")
            if abort is not None and clock.once_a_second():
                abort()
            if clock.pause():
                raise _Cancelled(name)

    def store(name: str, value: torch.Tensor) -> None:
        channel.put(name, pack({"v": value}))

    in_flight = max(1, in_flight)
    uplink = ThreadPoolExecutor(max_workers=in_flight, thread_name_prefix="uplink")
    downlink = ThreadPoolExecutor(max_workers=in_flight, thread_name_prefix="downlink")
    sent: list[Future[None]] = []

    def send(name: str, value: torch.Tensor) -> None:
        sent.append(uplink.submit(store, name, value))

    def drain() -> None:
        for future in sent:
            future.result()

    out = torch.empty_like(flat)
    slots = [list(torch.tensor_split(chunk, pieces)) for chunk in torch.tensor_split(out, replicas)]
    scattered = [scatter_piece_key(key, replica, j, p) for p in range(pieces) for j in sources]
    gathered = [reduced_piece_key(key, c, p) for c in sources for p in range(pieces)]
    try:
        for p in range(pieces):
            for c in scatter_order(replica, replicas):
                send(scatter_piece_key(key, c, replica, p), chunks[c][p])
        if not pipelined:
            drain()
        # Pipelined, the downloads of the reduced chunks queue right behind those of the own chunk.
        arriving = iter(_Prefetch(downlink, receive, scattered + gathered if pipelined else scattered, in_flight))
        for p in range(pieces):
            parts = {replica: chunks[replica][p]}
            for j in sources:
                parts[j] = next(arriving)
            total = slots[replica][p]  # the reduced piece goes straight into the result
            total.copy_(parts[0])
            for j in range(1, replicas):
                total += parts[j]
            send(reduced_piece_key(key, replica, p), total)
        if not pipelined:
            drain()
            arriving = iter(_Prefetch(downlink, receive, gathered, in_flight))
        for c in sources:
            for p in range(pieces):
                slots[c][p].copy_(next(arriving))
        drain()
    finally:
        stopped.set()  # on failure, pending downloads stop polling at once
        downlink.shutdown(wait=True, cancel_futures=True)
        uplink.shutdown(wait=True, cancel_futures=True)
    return out
