"""Training data in storage, and the order a run reads it in.

A region's split is written once as safetensors shards (`protocol.data_key(name, split,
shard_name(n))`: each flat input and target leaf stacked over the shard's samples) with a JSON
`DATA_META` beside them. Sample
order: iteration i reads global positions i*G .. i*G+G-1 (G the global batch); position g falls in
epoch g // N (N samples) and is sample perm_e[g % N] of that epoch's seeded permutation. The first
stage reads a micro-batch's inputs, the last its targets, and a plain PyTorch loop (the reference in
the tests) the same samples in the same order.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from typing import Any

import torch

from cloudless.ir.protocol import DATA_META, data_key, shard_name
from cloudless.ir.schedule import SHARD_SAMPLES
from cloudless.ir.workflow import Region

from .storage import Channel
from .tensors import pack, unpack


def data_name(region: Region) -> str:
    """Where a workflow region's training data is kept: under the region's name when it trains on its
    own shard, else (data moved between regions) under a name that also says which slices."""
    if not region.data_sources:
        return region.name
    sources = [source.to_json() for source in region.data_sources]
    digest = hashlib.sha256(json.dumps(sources, sort_keys=True).encode()).hexdigest()[:12]
    return f"{region.name}-{digest}"


def write_split(
    channel: Channel,
    region: str,
    split: str,
    samples: Iterable[tuple[list[torch.Tensor], list[torch.Tensor]]],
    shard_samples: int = SHARD_SAMPLES,
) -> int:
    """Write (flat inputs, flat targets) samples as shards; returns the number of samples."""
    count = 0
    shard: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []
    shapes: tuple[int, int] | None = None

    def flush(index: int) -> None:
        n_inputs, n_targets = shapes or (0, 0)
        values = {f"input_{j}": torch.stack([s[0][j] for s in shard]) for j in range(n_inputs)}
        values.update({f"target_{j}": torch.stack([s[1][j] for s in shard]) for j in range(n_targets)})
        channel.put(data_key(region, split, shard_name(index)), pack(values))
        shard.clear()

    for inputs, targets in samples:
        if shapes is None:
            shapes = (len(inputs), len(targets))
        shard.append(([torch.as_tensor(t) for t in inputs], [torch.as_tensor(t) for t in targets]))
        count += 1
        if len(shard) == shard_samples:
            flush(count // shard_samples - 1)
    if shard:
        flush((count - 1) // shard_samples)
    if shapes is None:
        raise ValueError(f"the {split} split of {region} has no samples")
    meta = {"samples": count, "shard_samples": shard_samples, "inputs": shapes[0], "targets": shapes[1]}
    channel.put(data_key(region, split, DATA_META), json.dumps(meta, sort_keys=True).encode())
    return count


class SplitReader:
    """Reads micro-batches of a split from its shards, caching the shards it has read."""

    def __init__(self, channel: Channel, region: str, split: str = "train") -> None:
        self.channel, self.region, self.split = channel, region, split
        self.meta: dict[str, Any] = json.loads(channel.get(data_key(region, split, DATA_META)))
        self._shards: dict[int, dict[str, torch.Tensor]] = {}

    @property
    def samples(self) -> int:
        return int(self.meta["samples"])

    def _shard(self, index: int) -> dict[str, torch.Tensor]:
        if index not in self._shards:
            self._shards[index] = unpack(self.channel.get(data_key(self.region, self.split, shard_name(index))))
        return self._shards[index]

    def gather(self, indices: list[int], kind: str) -> list[torch.Tensor]:
        """The flat `kind` ("input" or "target") tensors of these samples, stacked in order."""
        size = int(self.meta["shard_samples"])
        count = int(self.meta["inputs" if kind == "input" else "targets"])
        shards = sorted({i // size for i in indices})
        if len(shards) == 1:  # the usual case: one indexing op per tensor
            rows = torch.tensor([i - shards[0] * size for i in indices])
            return [self._shard(shards[0])[f"{kind}_{j}"][rows] for j in range(count)]
        wanted = torch.tensor(indices)
        of_shard = wanted // size
        gathered: list[torch.Tensor] = []
        for j in range(count):
            first = self._shard(shards[0])[f"{kind}_{j}"]
            out = torch.empty((len(indices), *first.shape[1:]), dtype=first.dtype)
            for shard in shards:
                here = of_shard == shard
                out[here] = self._shard(shard)[f"{kind}_{j}"][wanted[here] % size]
            gathered.append(out)
        return gathered
