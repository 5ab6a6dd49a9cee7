"""A first stage's micro-batches: training data where it lies (shards.py) through the user's code, or staged
by Cloudless (data.py), read alike.

The split's `meta` (written by the controller: `format` "webdataset" or "parquet", the shards with their
sample counts and versions; or "staged", Cloudless's own shards) says which shards there are. Micro-batch m
of iteration i is global positions i*G + m*B .. i*G + m*B + B - 1 (G the global batch, B the micro-batch),
each read where `ShardOrder` puts it. A sample where it lies is transformed by the model file's
`transform(sample, *, epoch, index)` with the random generators seeded by `sample_seed(seed, epoch, index)`,
and the B results collated by its `collate_fn(samples)` (default: torch's `default_collate`); a staged row
is a sample's tensors already, its leaves stacked. The result is `(inputs, target)`, as a map-style
dataset's item is: the inputs' leaves are the first stage's inputs, the target's the loss's targets.

The model file is imported from the package (`user/`, where the build put it and the modules beside it
that it imports), once per process; what it raises names the sample.
"""

from __future__ import annotations

import importlib.util
import json
import random
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils.data import default_collate

from ...ir.protocol import USER_FOLDER, members_key, user_module_name
from ...ir.sample_order import SHUFFLE_SHARDS, ShardLocation, ShardOrder, sample_seed
from ..storage.channels import Channel
from ..storage.shards import IN_PLACE_FORMATS, Members, MemberTables, Sample, ShardEntry, ShardError, ShardReader
from .data import stack_staged, staged_entries, staged_sample, staged_shards

_modules: dict[str, ModuleType] = {}


def user_module(package: Path, model_file: str) -> ModuleType:
    """The model file as the package holds it, imported once per process (its neighbours importable)."""
    path = (package / USER_FOLDER / Path(model_file).name).resolve()
    key = str(path)
    if key not in _modules:
        if not path.is_file():
            raise FileNotFoundError(
                f"{path}: the package holds no model file: it was compiled while load_shard gave a dataset, not "
                "shards where they lie, and its stage code calls none of the model file's functions; compile the "
                "model file again"
            )
        folder = str(path.parent)
        if folder not in sys.path:
            sys.path.insert(0, folder)  # as `python model.py` imports the modules beside it
        spec = importlib.util.spec_from_file_location(f"cloudless_user_{abs(hash(key))}", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        _modules[key] = module
    # the model file the stage code of this package calls (protocol.user_attribute), once it is loaded
    sys.modules[user_module_name(model_file)] = _modules[key]
    return _modules[key]


def seed_generators(seed: int) -> None:
    """Seed the generators a transform may draw from: torch's CPU generator, Python's, numpy's if loaded."""
    torch.default_generator.manual_seed(seed)
    random.seed(seed)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(seed)


def stored_member_tables(channel: Channel, name: str, split: str) -> MemberTables:
    """A reader's way to a split's member tables in the run's storage (`protocol.members_key`); a shard
    without one (listed by a wids index, or indexed by an older version) is parsed instead."""

    def table(entry: ShardEntry) -> Members | None:
        stored = channel.try_get(members_key(name, split, entry.location, entry.version))
        if stored is None:
            return None
        members = json.loads(stored)
        if not isinstance(members, list):
            raise ShardError(
                f"{channel.describe(members_key(name, split, entry.location, entry.version))}: not a table"
            )
        return [(str(n), int(at), int(size)) for n, at, size in members]

    return table


def entries_of(meta: dict[str, Any]) -> list[ShardEntry]:
    return [ShardEntry.from_json(shard) for shard in meta["shards"]]


class ShardBatches:
    """Micro-batches of a split, read by one function."""

    def __init__(
        self,
        meta: dict[str, Any],
        entries: list[ShardEntry],
        transform: Callable[..., Any] | None,
        collate: Callable[[list[Any]], Any],
        *,
        seed: int,
        micro_batch: int,
        global_batch: int,
        examples: tuple[list[Any] | None, list[Any] | None] = (None, None),
        members: MemberTables | None = None,
        load: Callable[[ShardEntry], list[Sample]] | None = None,
        keywords: tuple[str, ...] = (),
    ) -> None:
        """`transform`: the model file's (None: staged rows, taken as they are); `load`: how a shard is read,
        when not where it lies (`ShardReader`); `keywords`: the model's keyword inputs, which a collated dict
        gives by name (`flat_batch`)."""
        self.fingerprint = str(meta["fingerprint"])
        self.order = ShardOrder(
            tuple(e.samples for e in entries), seed, int(meta.get("shuffle_shards", SHUFFLE_SHARDS))
        )
        # a group's shards and the next group's first (a micro-batch straddling two groups reads the rest on demand)
        self.reader = ShardReader(entries, self.order.shuffle_shards + 1, members, load)
        self.transform, self.collate = transform, collate
        self.seed, self.micro_batch, self.global_batch = seed, micro_batch, global_batch
        #: the leaves of example_inputs' and example_targets' batch of a micro-batch (None: not given)
        self.examples = examples
        self.keywords = keywords

    @property
    def samples(self) -> int:
        return self.order.samples

    def positions(self, iteration: int, micro_batch: int) -> list[ShardLocation]:
        """Where the micro-batch's samples lie, in order."""
        first = iteration * self.global_batch + micro_batch * self.micro_batch
        return self.order.span(first, self.micro_batch)

    def name(self, located: ShardLocation) -> str:
        return f"sample {located.row} of {self.reader.entries[located.shard].name}"

    def prefetch(self, iteration: int, micro_batch: int) -> None:
        """Start reading the shards of that micro-batch that are not held (in the background), then the
        first shard of the group after its last sample's: the cache holds a group and one more shard, so
        the next group's first read overlaps this group's compute (the rest follow as it begins)."""
        wanted = [located.shard for located in self.positions(iteration, micro_batch)]
        self.reader.prefetch(wanted)
        current, following = self.order.groups_at(
            iteration * self.global_batch + (micro_batch + 1) * self.micro_batch - 1
        )
        # never in place of a shard that micro-batch reads (one straddling two groups reads the first's too)
        self.reader.prefetch_spare(following[0], keep=set(current) | set(wanted))

    def read(self, located: ShardLocation) -> Sample:
        """The sample as the shard holds it (its shard read whole, if it is not held)."""
        return self.reader.sample(located.shard, located.row)

    def transformed(self, located: ShardLocation, sample: Sample) -> Any:
        """The model file's transform of it, the generators seeded for this sample and epoch (a staged row:
        its tensors as they are)."""
        if self.transform is None:
            return staged_sample(sample)
        seed_generators(sample_seed(self.seed, located.epoch, located.index))
        return self.transform(sample, epoch=located.epoch, index=located.index)

    def in_order(self, size: int) -> Iterator[tuple[list[Any], list[Any]]]:
        """The split's whole micro-batches of `size` in its listed order, as flat (inputs, targets): a test
        split as the controller evaluates it (epoch 0; the samples transformed as in training)."""
        pending: list[Any] = []
        index = 0
        for shard, entry in enumerate(self.reader.entries):
            for row in range(entry.samples):
                located = ShardLocation(0, shard, row, index)
                pending.append(self.transformed(located, self.read(located)))
                index += 1
                if len(pending) == size:
                    yield flat_batch(self.collate(pending), self.keywords)
                    pending = []


def open_batches(
    channel: Channel,
    meta: dict[str, Any],
    name: str,
    split: str,
    user: Callable[[], ModuleType],
    *,
    seed: int,
    micro_batch: int,
    global_batch: int,
    timeout: float,
) -> ShardBatches:
    """A split's micro-batches, as its `meta` (under `name` in the run's storage) says it is stored: shards
    where they lie through the model file (`user()`, imported only then), or staged shards as they are."""
    if meta.get("format") not in IN_PLACE_FORMATS:
        return ShardBatches(
            meta,
            staged_entries(meta, name, split),
            None,
            stack_staged,
            seed=seed,
            micro_batch=micro_batch,
            global_batch=global_batch,
            load=staged_shards(channel, meta, timeout),
        )
    module = user()
    example = module.example_inputs(micro_batch)
    return ShardBatches(
        meta,
        entries_of(meta),
        module.transform,
        getattr(module, "collate_fn", None) or default_collate,
        seed=seed,
        micro_batch=micro_batch,
        global_batch=global_batch,
        examples=example_leaves(module, micro_batch),
        members=stored_member_tables(channel, name, split),
        keywords=tuple(example) if isinstance(example, Mapping) else (),
    )


def example_leaves(module: ModuleType, micro_batch: int) -> tuple[list[Any] | None, list[Any] | None]:
    """The leaves of the model file's example_inputs and example_targets at the micro-batch (None for one it
    does not define): what a collated batch is checked against."""
    leaves: list[list[Any] | None] = []
    for name in ("example_inputs", "example_targets"):
        make = getattr(module, name, None)
        leaves.append(pytree.tree_leaves(make(micro_batch)) if callable(make) else None)
    return leaves[0], leaves[1]


def flat_batch(batch: Any, keywords: tuple[str, ...] = ()) -> tuple[list[Any], list[Any]]:
    """A collated `(inputs, target)`'s leaves: the first stage's inputs, and the loss's targets. For a model of
    keyword inputs, a collated dict (a Hugging Face data collator's) gives them by name, and no target."""
    if keywords and isinstance(batch, Mapping):
        missing = [key for key in keywords if key not in batch]
        if missing:
            raise TypeError(f"the collated batch has no {missing[0]!r}; it has {', '.join(map(str, batch))}")
        return [batch[key] for key in keywords], []
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise TypeError(f"expected the collated batch to be (inputs, target), got a {type(batch).__name__}")
    inputs, target = batch
    return pytree.tree_leaves(tuple(inputs) if isinstance(inputs, list) else inputs), pytree.tree_leaves(target)


def batch_difference(
    what: str, leaves: list[Any], example: list[Any], micro_batch: int, fixed_shapes: bool = False
) -> str | None:
    """How a collated micro-batch's `what` (inputs, targets) differ from the example batch's leaves, or None:
    as many tensors, each of the example's dtype and number of dimensions, `micro_batch` long in the first;
    the other sizes may differ (a collate_fn pads each batch to its longest sample) unless the stages run at
    the example's shapes only (`fixed_shapes`: torch.export traced them)."""
    if len(leaves) != len(example):
        return f"{len(leaves)} {what} tensors, but example_{what}(batch_size) gives {len(example)}"
    for index, (leaf, expected) in enumerate(zip(leaves, example, strict=True)):
        if not isinstance(expected, torch.Tensor):
            continue
        if not isinstance(leaf, torch.Tensor):
            return f"{what} {index} is a {type(leaf).__name__}, but example_{what}'s is a tensor"
        found, wanted = f"{str(leaf.dtype).removeprefix('torch.')} {list(leaf.shape)}", str(expected.dtype)
        if leaf.dtype != expected.dtype or leaf.dim() != expected.dim():
            wanted = f"{wanted.removeprefix('torch.')} of {expected.dim()} dimensions"
            return f"{what} {index} is {found}, but example_{what}'s is {wanted} ({list(expected.shape)})"
        if leaf.dim() and leaf.shape[0] != micro_batch:
            return f"{what} {index} is {found}: {leaf.shape[0]} samples, where the micro-batch is {micro_batch}"
        if fixed_shapes and what == "inputs" and leaf.shape != expected.shape:
            return (
                f"{what} {index} is {found}, but torch.export traced the model at example_{what}'s "
                f"{list(expected.shape)} and its stages run at those sizes only: pad every batch to them in "
                "collate_fn, or compile with --tracer fx if the model traces so"
            )
    return None
