"""Training data in storage, and the order a run reads it in.

A region's split is written as safetensors shards (`protocol.data_key(name, split,
shard_name(n))`: each flat input and target leaf stacked over the shard's samples) with a JSON
`DATA_META` beside them. Sample
order: iteration i reads global positions i*G .. i*G+G-1 (G the global batch); position g falls in
epoch g // N (N samples) and is sample perm_e[g % N] of that epoch's seeded permutation. The first
stage reads a micro-batch's inputs, the last its targets, and a plain PyTorch loop (the reference in
the tests) the same samples in the same order.

The data is shared by every run on the same storage, and the model file that gives it can change
between runs, so a split is fingerprinted: `meta` holds a sha256 of the samples' content (every
leaf's dtype, shape and bytes, in order, and the sample count) and one digest per shard, each shard
carries its own digest, and `write_split` rewrites only what differs. Readers open `meta` first and
read shards by it, so a re-staging deletes `meta` before it touches a shard and writes it last. What it
would reuse it reads back first: a shard (or `meta`) that is damaged or gone is re-staged, never reused.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ...ir.protocol import DATA_META, MEMBERS_FOLDER, CorruptBlob, data_key, shard_name
from ...ir.schedule import SHARD_SAMPLES
from ...ir.workflow import Region
from ..storage.channels import Channel
from ..storage.tensors import pack, unpack

#: the hash a fingerprint was made with leads it, so that a change of hash reads as changed data
FINGERPRINT_PREFIX = "sha256:"
#: a shard's own digest, kept in its safetensors metadata (`tensors.pack`): a reader checks it
#: against its `meta`, which tells a shard of another staging from one of the staging it reads
SHARD_DIGEST = "shard_digest"
#: what `write_split` did with a split: wrote it where there was none, replaced different (or
#: unfingerprinted) data, or found the same content in storage and wrote nothing; or, for shards where
#: they lie, wrote their index (`staging.index_in_place`)
Staging = Literal["staged", "restaged", "reused", "indexed"]
#: the fields of `meta` that say which data the shards hold (the rest is provenance)
_CONTENT_FIELDS = ("samples", "shard_samples", "inputs", "targets", "fingerprint", "shard_digests")

Sample = tuple[list[torch.Tensor], list[torch.Tensor]]


class SplitChangedError(RuntimeError):
    """A shard is not of the staging the reader's `meta` describes: the split was re-staged while it
    was being read (another run on the same storage, with other data)."""


@dataclass(frozen=True)
class WrittenSplit:
    """What `write_split` found and did."""

    samples: int
    fingerprint: str
    action: Staging
    #: why it was re-staged when the stored data was damaged (a shard or meta corrupt or gone), else ""
    reason: str = ""
    #: for shards where they lie, what indexing them read (shards, requests, bytes)
    read: str = ""


def data_name(region: Region) -> str:
    """Where a workflow region's training data is kept: under the region's name when it trains on its
    own shard, else (data moved between regions) under a name that also says which slices."""
    if not region.data_sources:
        return region.name
    sources = [source.to_json() for source in region.data_sources]
    digest = hashlib.sha256(json.dumps(sources, sort_keys=True).encode()).hexdigest()[:12]
    return f"{region.name}-{digest}"


def _content(inputs: list[torch.Tensor], targets: list[torch.Tensor]) -> Iterator[bytes | memoryview]:
    """A sample as the fingerprint sees it: per leaf its role, position, dtype and shape, then its
    bytes (their length follows from dtype and shape, so the stream parses one way only)."""
    for kind, leaves in (("input", inputs), ("target", targets)):
        for j, leaf in enumerate(leaves):
            yield f"{kind}_{j}:{leaf.dtype}:{list(leaf.shape)};".encode()
            yield leaf.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data


def read_meta(channel: Channel, region: str, split: str) -> dict[str, Any] | None:
    """The split's `meta` as stored; {} when it is unreadable (so it is replaced), None when absent."""
    return _meta(channel, region, split)[0]


def _meta(channel: Channel, region: str, split: str) -> tuple[dict[str, Any] | None, str]:
    """`read_meta`, and why it is unreadable ("" when it is not)."""
    key = data_key(region, split, DATA_META)
    try:
        raw = channel.try_get(key)
        if raw is None:
            return None, ""
        meta = json.loads(raw)
    except CorruptBlob as exc:
        return {}, str(exc)
    except ValueError:
        return {}, f"{channel.describe(key)} is not JSON"
    return (meta, "") if isinstance(meta, dict) else ({}, f"{channel.describe(key)} is not a JSON object")


def _shard_damage(channel: Channel, key: str, digest: str) -> str | None:
    """Why the stored shard at `key` is not the whole shard of digest `digest` (corrupt, gone, another
    shard's), or None: staging reads back what it would reuse, as a run's functions will read it."""
    try:
        data = channel.try_get(key)
    except CorruptBlob as exc:
        return str(exc)
    if data is None:
        return f"{channel.describe(key)} is missing"
    try:
        stored = unpack(data).get(SHARD_DIGEST)
    except Exception as exc:  # noqa: BLE001 - whatever safetensors or JSON raise for bytes that do not decode
        return f"{channel.describe(key)} does not decode: {type(exc).__name__}: {exc}"
    return None if stored == digest else f"{channel.describe(key)} holds other data than the split's meta records"


def delete_shards(channel: Channel, region: str, split: str, first: int = 0) -> None:
    """Delete the split's shards from `first` on. Top down, so that a clean-up cut short leaves a
    contiguous run of shards, which the next one finds by probing upwards."""
    last = first
    while channel.exists(data_key(region, split, shard_name(last))):
        last += 1
    for index in reversed(range(first, last)):
        channel.delete(data_key(region, split, shard_name(index)))


def remove_split(channel: Channel, region: str, split: str) -> None:
    """Delete a split: `meta` first (readers then see no split, never one without its shards), then its
    staged shards, or the member tables of its shards where they lie."""
    channel.delete(data_key(region, split, DATA_META))
    delete_shards(channel, region, split)
    channel.delete_prefix(data_key(region, split, MEMBERS_FOLDER + "/"))


def write_split(
    channel: Channel,
    region: str,
    split: str,
    samples: Iterable[Sample],
    shard_samples: int = SHARD_SAMPLES,
    *,
    force: bool = False,
    provenance: Mapping[str, Any] | None = None,
) -> WrittenSplit:
    """Write (flat inputs, flat targets) samples as shards, unless storage holds the same content.

    One pass, one shard in memory: each shard's digest is compared with the stored `meta`'s, and
    shards are written from the first that differs (all of them with `force`, or when `meta` has no
    digests: staged by an older version), or whose stored copy is damaged or gone (each shard it would
    reuse is read back: the reason is returned). Before that first write `meta` is deleted, and the new one
    is written last, after any surplus shards of a larger earlier staging are deleted: a reader opens
    `meta` first, so it waits for the staging, or reads one staging, never a mix. Same content: no
    writes at all. `provenance` (say, the model file's digest) is recorded but never compared."""
    meta_key = data_key(region, split, DATA_META)
    previous, damage = _meta(channel, region, split)
    stored = None if force or previous is None else previous.get("shard_digests")
    if not (previous and previous.get("shard_samples") == shard_samples and isinstance(stored, list)):
        stored = []  # nothing comparable: every shard is written
    whole, part = hashlib.sha256(), hashlib.sha256()
    digests: list[str] = []
    shard: list[Sample] = []
    leaves: tuple[int, int] | None = None
    count = 0
    diverged = False

    def diverge() -> None:
        nonlocal diverged
        if not diverged:
            channel.delete(meta_key)  # from now on a reader waits for the new meta
            diverged = True

    def flush() -> None:
        nonlocal part, damage
        index, digest = len(digests), part.hexdigest()
        digests.append(digest)
        part = hashlib.sha256()
        key = data_key(region, split, shard_name(index))
        if not diverged and index < len(stored) and stored[index] == digest:
            found = _shard_damage(channel, key, digest)
            if found is None:
                shard.clear()  # storage holds this shard already
                return
            damage = found
        diverge()
        n_inputs, n_targets = leaves or (0, 0)
        columns = {f"input_{j}": [s[0][j] for s in shard] for j in range(n_inputs)}
        columns.update({f"target_{j}": [s[1][j] for s in shard] for j in range(n_targets)})
        values: dict[str, Any] = {}
        for column, tensors in columns.items():
            shapes = sorted({tuple(t.shape) for t in tensors})
            if len(shapes) > 1:  # torch.stack's own error names neither the split nor the samples
                first = index * shard_samples
                raise ValueError(
                    f"the {split} split of {region}: {column.replace('_', ' ')} of samples {first}.."
                    f"{first + len(tensors) - 1} has shapes {', '.join(map(str, shapes[:3]))}; every sample's "
                    "must have one shape (pad or crop them in load_shard)"
                )
            values[column] = torch.stack(tensors)
        values[SHARD_DIGEST] = digest
        channel.put(key, pack(values))
        shard.clear()

    for raw_inputs, raw_targets in samples:
        inputs, targets = [torch.as_tensor(t) for t in raw_inputs], [torch.as_tensor(t) for t in raw_targets]
        if leaves is None:
            leaves = (len(inputs), len(targets))
        elif (len(inputs), len(targets)) != leaves:
            raise ValueError(
                f"sample {count} of the {split} split of {region} has {len(inputs)} input and {len(targets)} "
                f"target tensors, sample 0 had {leaves[0]} and {leaves[1]}"
            )
        for chunk in _content(inputs, targets):
            whole.update(chunk)
            part.update(chunk)
        shard.append((inputs, targets))
        count += 1
        if len(shard) == shard_samples:
            flush()
    if shard:
        flush()
    if leaves is None:
        remove_split(channel, region, split)  # what is stored is not what the data is now
        raise ValueError(f"the {split} split of {region} has no samples")
    whole.update(f"samples={count}".encode())
    meta: dict[str, Any] = {
        "samples": count,
        "shard_samples": shard_samples,
        "inputs": leaves[0],
        "targets": leaves[1],
        "fingerprint": FINGERPRINT_PREFIX + whole.hexdigest(),
        "shard_digests": digests,
    }
    if not diverged and previous and all(previous.get(f) == meta[f] for f in _CONTENT_FIELDS):
        return WrittenSplit(count, meta["fingerprint"], "reused")
    diverge()
    delete_shards(channel, region, split, first=len(digests))
    if provenance:
        meta["staged_from"] = dict(provenance)
    channel.put(meta_key, json.dumps(meta, sort_keys=True).encode())
    return WrittenSplit(count, meta["fingerprint"], "staged" if previous is None else "restaged", damage)


def read_split_meta(channel: Channel, region: str, split: str, timeout: float) -> dict[str, Any]:
    """The split's `meta`, waited for up to `timeout` (the controller writes it before any function starts)."""
    meta = json.loads(channel.get(data_key(region, split, DATA_META), timeout))
    if not isinstance(meta, dict):
        raise ValueError(f"{channel.describe(data_key(region, split, DATA_META))}: not a JSON object")
    return meta


class SplitReader:
    """Reads micro-batches of a split from its shards, caching the shards it has read. It reads
    `meta` once and by it only: the samples it counts, and shards of the staging it describes."""

    def __init__(
        self,
        channel: Channel,
        region: str,
        split: str = "train",
        timeout: float = 600.0,
        meta: dict[str, Any] | None = None,
    ) -> None:
        """`timeout`: how long to wait for the split to be staged (the invocation's key timeout); `meta`: the
        split's, when the caller read it (`read_split_meta`)."""
        self.channel, self.region, self.split, self.timeout = channel, region, split, timeout
        self.meta: dict[str, Any] = meta if meta is not None else read_split_meta(channel, region, split, timeout)
        self._shards: dict[int, dict[str, torch.Tensor]] = {}

    @property
    def samples(self) -> int:
        return int(self.meta["samples"])

    @property
    def fingerprint(self) -> str | None:
        """The content's fingerprint (None for a split staged before there were fingerprints)."""
        fingerprint = self.meta.get("fingerprint")
        return fingerprint if isinstance(fingerprint, str) else None

    def _shard(self, index: int) -> dict[str, torch.Tensor]:
        if index not in self._shards:
            size = int(self.meta["shard_samples"])
            values = unpack(self.channel.get(data_key(self.region, self.split, shard_name(index)), self.timeout))
            digest = values.pop(SHARD_DIGEST, None)
            expected = self.meta.get("shard_digests")
            rows = {v.shape[0] for v in values.values() if isinstance(v, torch.Tensor)}
            wanted = min(size, self.samples - index * size)
            other = isinstance(expected, list) and (index >= len(expected) or digest != expected[index])
            if other or rows - {wanted}:
                raise SplitChangedError(
                    f"{self.channel.describe(data_key(self.region, self.split, shard_name(index)))} is not of the "
                    f"staging this run read (fingerprint {self.fingerprint}): the {self.split} split of "
                    f"{self.region} was staged again, with other data, while the run read it"
                )
            self._shards[index] = values
        return self._shards[index]

    def gather(self, indices: list[int], kind: str) -> list[torch.Tensor]:
        """The flat `kind` ("input" or "target") tensors of these samples, stacked in order."""
        if indices and not 0 <= min(indices) <= max(indices) < self.samples:
            bad = next(i for i in indices if not 0 <= i < self.samples)
            raise IndexError(f"sample {bad} of the {self.split} split of {self.region}: it has {self.samples}")
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
