"""Gradient synchronisation among the replicas of a stage through storage.

The pipelined scatter-reduce (FuncPipe): replica i owns chunk i of the flat gradient. It uploads
every other chunk, piece by piece in the staggered order of `scatter_order`, while it downloads the
pieces of its own chunk and reduces each piece as soon as every replica's copy has arrived, then
uploads the reduced piece; last it downloads the reduced chunks of the others. Uploads run on their
own thread (the function's uplink) while the main thread downloads (its downlink). The sequential
variant finishes each phase before the next starts, for comparison.

Each reduced chunk is computed once, by its owner, summing in replica order, so every replica ends
with bit-identical gradients.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from .schedule import gather_sources, scatter_order, sync_pieces
from .storage import Channel
from .tensors import pack, unpack


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
) -> torch.Tensor:
    """The sum of `flat` over the stage's replicas (every replica calls this with its own)."""
    if replicas == 1:
        return flat
    pieces = sync_pieces(flat.numel() * flat.element_size(), replicas, piece_bytes, max_pieces)
    chunks = [list(torch.tensor_split(chunk, pieces)) for chunk in torch.tensor_split(flat, replicas)]

    def receive(name: str) -> torch.Tensor:
        return unpack(channel.get(name, timeout))["v"]

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="uplink") as uplink:
        sent: list[Future[None]] = []

        def send(name: str, value: torch.Tensor) -> None:
            sent.append(uplink.submit(channel.put, name, pack({"v": value})))

        def drain() -> None:
            for future in sent:
                future.result()

        for c in scatter_order(replica, replicas):
            for p, piece in enumerate(chunks[c]):
                send(f"{key}/c{c}/from{replica}/p{p}", piece)
        if not pipelined:
            drain()
        reduced: list[torch.Tensor] = []
        for p in range(pieces):
            parts = {replica: chunks[replica][p]}
            for j in gather_sources(replica, replicas):
                parts[j] = receive(f"{key}/c{replica}/from{j}/p{p}")
            total = parts[0].clone()
            for j in range(1, replicas):
                total += parts[j]
            reduced.append(total)
            send(f"{key}/r{replica}/p{p}", total)
        if not pipelined:
            drain()
        result = {replica: torch.cat(reduced)}
        for c in gather_sources(replica, replicas):
            result[c] = torch.cat([receive(f"{key}/r{c}/p{p}") for p in range(pieces)])
        drain()
    return torch.cat([result[c] for c in range(replicas)])
