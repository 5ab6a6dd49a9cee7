"""The order a run reads its training data in: a function of (seed, epoch, global position) alone.

Training data lies in shards (WebDataset tars, Parquet files, or Cloudless's own staged shards), read a shard
at a time, so a run cannot draw its samples from one permutation of the whole split: every micro-batch would
touch another shard, and a function would hold them all. The order here is MosaicML Streaming's kind,
shuffled at two levels, so that reading stays local and the order stays a pure function:

1. each epoch permutes the shards (a seeded `torch.randperm` of the shard count);
2. the permuted shards are taken in groups of `shuffle_shards` (the last group may be smaller), and the
   samples of each group are permuted together (a seeded permutation of the group's sample count).

Global position g is in epoch e = g // N (N samples over every shard) at position p = g % N of that epoch;
p falls in one group, and the group's permutation maps it to one of the group's samples. Position g is
read by whichever function reads it: the order does not depend on the replicas, functions or regions that
read it (a re-plan mid-run keeps it), a resumed run continues it from any position, and a plain PyTorch
loop calling `ShardOrder.at` reads the same samples. A function reading a group's positions holds at most
that group's shards (`shuffle_shards`), the bound its shard cache is sized by.

Shards shuffled locally want samples that are not sorted (a folder of images by class, IMDB's reviews by
label), so a dataset `cloudless-run` stages from `load_shard` is written in a shuffled order, as Streaming
advises for its shards: row r of a staged train split holds the dataset's sample `staging_order(N)[r]`, a
permutation seeded by the sample count alone (the same dataset stages the same shards, whatever the run's
seed). A stream (an IterableDataset) is staged in the order it comes in. Staged shards hold `SHARD_SAMPLES`
samples, or fewer where a sample is large: about `STAGED_SHARD_BYTES` a shard, so that a function's cache
of `shuffle_shards + 1` of them stays small (`staged_shard_samples`).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from functools import lru_cache

import torch

#: shards whose samples each epoch shuffles together, by default (each function's shard cache holds as many)
SHUFFLE_SHARDS = 4
#: shards' bytes a first stage holds at most: its cache's (a shuffle group's and one more), and the one being
#: read three times more while it is read (its bytes as read, unsealed and decoded: bench/data_bench.py, 4.)
HELD_SHARDS = SHUFFLE_SHARDS + 4
#: a staged shard holds at most this many samples, and no more than about STAGED_SHARD_BYTES of them
SHARD_SAMPLES = 4096
STAGED_SHARD_BYTES = 16 * 2**20
#: what a staged train split's permutation is seeded by, with its sample count (`staging_order`)
STAGING_SEED = 0


def _generator(*parts: int) -> torch.Generator:
    seed = 0
    for part in parts:  # a mix of the parts that does not collide for small values (seed, epoch, group)
        seed = (seed * 1_000_003 + part) % 2**63
    return torch.Generator().manual_seed(seed)


@dataclass(frozen=True)
class ShardLocation:
    """Where a global position's sample lies: its shard, its row within the shard, and its index in the
    split (shards in their listed order, rows in order: what a `transform` is told as `index`)."""

    epoch: int
    shard: int
    row: int
    index: int


@dataclass(frozen=True)
class ShardOrder:
    """The order over shards of `shard_samples` samples each (in the split's listed order), seeded by `seed`."""

    shard_samples: tuple[int, ...]
    seed: int
    shuffle_shards: int = SHUFFLE_SHARDS
    _starts: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.shard_samples or min(self.shard_samples) < 0 or sum(self.shard_samples) == 0:
            raise ValueError(f"shard sample counts: expected some samples, got {list(self.shard_samples)[:8]}")
        if self.shuffle_shards < 1:
            raise ValueError(f"shuffle_shards: expected at least 1, got {self.shuffle_shards}")
        starts, total = [], 0
        for count in self.shard_samples:
            starts.append(total)
            total += count
        object.__setattr__(self, "_starts", tuple(starts))

    @property
    def samples(self) -> int:
        return sum(self.shard_samples)

    def at(self, position: int) -> ShardLocation:
        """The sample read at global position `position` (0 is the run's first)."""
        if position < 0:
            raise ValueError(f"position: expected 0 or more, got {position}")
        epoch, within = divmod(position, self.samples)
        shards, group_starts = _epoch_layout(self, epoch)
        group = bisect.bisect_right(group_starts, within) - 1
        first_shard = group * self.shuffle_shards
        members = shards[first_shard : first_shard + self.shuffle_shards]
        taken = int(_group_permutation(self, epoch, group)[within - group_starts[group]])
        for shard in members:  # the group's samples: its shards' rows, shard after shard
            if taken < self.shard_samples[shard]:
                return ShardLocation(epoch, shard, taken, self._starts[shard] + taken)
            taken -= self.shard_samples[shard]
        raise AssertionError("a group's permutation stays within its samples")

    def groups_at(self, position: int) -> tuple[list[int], list[int]]:
        """The shards of the group position `position` lies in, and of the group read after it (the next
        epoch's first after the last): what a reader holds, and what it may start on meanwhile."""
        epoch, within = divmod(position, self.samples)
        shards, group_starts = _epoch_layout(self, epoch)
        group = bisect.bisect_right(group_starts, within) - 1
        first = group * self.shuffle_shards
        current = shards[first : first + self.shuffle_shards]
        if group + 1 < len(group_starts):
            return current, shards[first + self.shuffle_shards : first + 2 * self.shuffle_shards]
        following, _ = _epoch_layout(self, epoch + 1)
        return current, following[: self.shuffle_shards]

    def span(self, first: int, count: int) -> list[ShardLocation]:
        """The samples of positions first .. first + count - 1, in order."""
        return [self.at(position) for position in range(first, first + count)]


@lru_cache(maxsize=8)
def _epoch_layout(order: ShardOrder, epoch: int) -> tuple[list[int], list[int]]:
    """The epoch's shard permutation, and where each group of it starts among the epoch's positions."""
    shards = torch.randperm(len(order.shard_samples), generator=_generator(order.seed, epoch)).tolist()
    starts, total = [], 0
    for first in range(0, len(shards), order.shuffle_shards):
        starts.append(total)
        total += sum(order.shard_samples[s] for s in shards[first : first + order.shuffle_shards])
    return shards, starts


@lru_cache(maxsize=64)
def _group_permutation(order: ShardOrder, epoch: int, group: int) -> torch.Tensor:
    shards, _ = _epoch_layout(order, epoch)
    members = shards[group * order.shuffle_shards : (group + 1) * order.shuffle_shards]
    size = sum(order.shard_samples[s] for s in members)
    return torch.randperm(size, generator=_generator(order.seed, epoch, group + 1))


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The seed of the random generators (torch's, Python's `random`, numpy's) as a `transform` of sample
    `index` (its place in the split) runs in epoch `epoch` of a run seeded `seed`: its augmentation is the
    same whichever function reads it, and a plain loop seeding them so draws the same."""
    return ((seed * 1_000_003 + epoch) * 1_000_003 + index) % 2**32


def staged_shard_samples(sample_bytes: int) -> int:
    """Samples a staged shard holds, for samples of `sample_bytes` (their tensors' bytes)."""
    return max(1, min(SHARD_SAMPLES, STAGED_SHARD_BYTES // max(1, sample_bytes)))


def shard_counts(samples: int, shard_samples: int) -> tuple[int, ...]:
    """The sample count of each of a staged split's shards: `shard_samples` each, the last the rest."""
    full, rest = divmod(samples, shard_samples)
    return (shard_samples,) * full + ((rest,) if rest else ())


def staging_order(samples: int) -> torch.Tensor:
    """The dataset's sample at each row of a staged train split of `samples` (a map-style dataset's)."""
    return torch.randperm(samples, generator=_generator(STAGING_SEED, samples))
