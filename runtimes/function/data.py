"""Training data staged in the run's storage, as Cloudless's own shards.

A region's split is written as safetensors shards (`protocol.data_key(name, split,
shard_name(n))`: each flat input and target leaf stacked over the shard's samples) with a JSON
`DATA_META` beside them (`format` "staged"). A train split's rows are the dataset's samples in
`sample_order.staging_order`, a stream's as they come. The functions read them as they read shards where
they lie (`batches.py`: the same order, cache and prefetch), a staged shard's rows its samples
(`staged_shards`), and a plain PyTorch loop (the reference in the tests) the same samples in the same order.

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
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ...ir.protocol import DATA_META, MEMBERS_FOLDER, CorruptBlob, data_key, shard_name
from ...ir.sample_order import SHUFFLE_SHARDS, shard_counts, staged_shard_samples
from ...ir.workflow import Region
from ..storage.channels import Channel
from ..storage.shards import Sample as ShardSample
from ..storage.shards import ShardEntry, ShardError
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
#: a staged split's `meta` format (those of shards where they lie are `shards.IN_PLACE_FORMATS`)
STAGED = "staged"

Sample = tuple[list[torch.Tensor], list[torch.Tensor]]


class SplitChangedError(ShardError):
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
    shard_samples: int | None = None,
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
    writes at all. `provenance` (say, the model file's digest) is recorded but never compared. A shard
    holds `shard_samples`, by default as many as `sample_order.staged_shard_samples` gives for the first
    sample's bytes."""
    meta_key = data_key(region, split, DATA_META)
    previous, damage = _meta(channel, region, split)
    stored: list[str] = []  # the stored shards' digests, when they are comparable (set by the first sample)
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
                first = index * int(shard_samples or 0)
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
            if shard_samples is None:
                shard_samples = staged_shard_samples(sum(t.nbytes for t in (*inputs, *targets)))
            digests_before = None if force or previous is None else previous.get("shard_digests")
            if previous and previous.get("shard_samples") == shard_samples and isinstance(digests_before, list):
                stored = digests_before
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
        "format": STAGED,
        "shuffle_shards": SHUFFLE_SHARDS,
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


def staged_entries(meta: dict[str, Any], name: str, split: str) -> list[ShardEntry]:
    """A staged split's shards as the reader's index: each shard's key, sample count and digest (its version)."""
    counts = shard_counts(int(meta["samples"]), int(meta["shard_samples"]))
    digests = meta.get("shard_digests")
    versions = [str(d) for d in digests] if isinstance(digests, list) else [""] * len(counts)
    return [
        ShardEntry(
            data_key(name, split, shard_name(index)), count, 0, versions[index] if index < len(versions) else "?"
        )
        for index, count in enumerate(counts)
    ]


def staged_shards(channel: Channel, meta: dict[str, Any], timeout: float) -> Callable[[ShardEntry], list[ShardSample]]:
    """How a reader reads a staged shard (waiting up to `timeout` for it): its rows as samples,
    `{"inputs": [tensor, ...], "targets": [tensor, ...]}`, checked to be of the staging `meta` describes."""
    n_inputs, n_targets = int(meta["inputs"]), int(meta["targets"])

    def read(entry: ShardEntry) -> list[ShardSample]:
        values = unpack(channel.get(entry.location, timeout))
        digest = values.pop(SHARD_DIGEST, None)
        rows = {v.shape[0] for v in values.values() if isinstance(v, torch.Tensor)}
        if (entry.version and digest != entry.version) or rows - {entry.samples}:
            raise SplitChangedError(
                f"{channel.describe(entry.location)} is not of the staging this run read (fingerprint "
                f"{meta.get('fingerprint')}): the split was staged again, with other data, while the run read it"
            )
        inputs = [values[f"input_{j}"].unbind(0) for j in range(n_inputs)]
        targets = [values[f"target_{j}"].unbind(0) for j in range(n_targets)]
        return [
            {"inputs": [leaf[row] for leaf in inputs], "targets": [leaf[row] for leaf in targets]}
            for row in range(entry.samples)
        ]

    return read


def staged_sample(sample: ShardSample) -> Sample:
    """A staged row as a dataset's item is: (inputs, target), as flat leaves; copies, so that a micro-batch
    being gathered keeps no shard it has let go of (a row is a view of its shard's tensors)."""
    return [t.clone() for t in sample["inputs"]], [t.clone() for t in sample["targets"]]


def stack_staged(
    samples: list[tuple[list[torch.Tensor], list[torch.Tensor]]],
) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """Staged rows collated: each input and target leaf stacked over the micro-batch."""
    inputs = tuple(torch.stack([s[0][j] for s in samples]) for j in range(len(samples[0][0])))
    return inputs, tuple(torch.stack([s[1][j] for s in samples]) for j in range(len(samples[0][1])))
