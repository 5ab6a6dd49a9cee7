"""The sharded sample order: each epoch a permutation of every sample, local to groups of shards, a pure
function of (seed, epoch, position)."""

from __future__ import annotations

import pytest

from cloudless.ir.sample_order import ShardOrder

SHARDS = (5, 3, 0, 7, 4, 6, 2)  # uneven, one empty


def test_every_epoch_reads_every_sample_once_and_epochs_differ() -> None:
    order = ShardOrder(SHARDS, seed=7, shuffle_shards=2)
    n = order.samples
    epochs = [[(s.shard, s.row) for s in order.span(e * n, n)] for e in range(3)]
    every = sorted((shard, row) for shard, count in enumerate(SHARDS) for row in range(count))
    for epoch, read in enumerate(epochs):
        assert sorted(read) == every, epoch
        assert {s.epoch for s in order.span(epoch * n, n)} == {epoch}
    assert epochs[0] != epochs[1] != epochs[2]
    # index: the sample's place in the split, shards in their listed order
    for located in order.span(0, n):
        assert located.index == sum(SHARDS[: located.shard]) + located.row


def test_the_order_is_a_function_of_seed_and_position_alone() -> None:
    order = ShardOrder(SHARDS, seed=7, shuffle_shards=2)
    whole = order.span(0, 3 * order.samples)
    # read in any pieces, in any order, by a fresh object (another function, a resumed run): the same
    again = ShardOrder(SHARDS, seed=7, shuffle_shards=2)
    pieces = [again.span(first, 4) for first in range(len(whole) - 4, -1, -4)]
    assert [s for piece in reversed(pieces) for s in piece] == whole[len(whole) % 4 :]
    assert again.at(len(whole) - 1) == whole[-1]
    assert ShardOrder(SHARDS, seed=8, shuffle_shards=2).span(0, order.samples) != whole[: order.samples]


def test_a_group_of_positions_reads_at_most_its_shards() -> None:
    order = ShardOrder(tuple([10] * 12), seed=3, shuffle_shards=3)
    for epoch in range(2):
        for group in range(4):
            first = epoch * order.samples + group * 30
            assert len({s.shard for s in order.span(first, 30)}) == 3
    # shuffled within a group: not the rows in shard order
    rows = [(s.shard, s.row) for s in order.span(0, 30)]
    assert rows != sorted(rows)


def test_one_shard_is_one_permutation_and_one_group_of_all_is_a_full_shuffle() -> None:
    single = ShardOrder((50,), seed=1)
    assert sorted(s.row for s in single.span(0, 50)) == list(range(50))
    full = ShardOrder((10, 10, 10), seed=1, shuffle_shards=3)
    first_ten = {s.shard for s in full.span(0, 10)}
    assert len(first_ten) > 1  # the shards' samples mixed


@pytest.mark.parametrize(
    ("shards", "shuffle", "message"),
    [((), 4, "expected some samples"), ((0, 0), 4, "expected some samples"), ((3, -1), 4, "expected some"),
     ((3,), 0, "shuffle_shards: expected at least 1")],
)  # fmt: skip
def test_bad_counts_are_refused(shards: tuple[int, ...], shuffle: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ShardOrder(shards, seed=0, shuffle_shards=shuffle)
    with pytest.raises(ValueError, match="position"):
        ShardOrder((3,), seed=0).at(-1)


def test_the_group_a_position_lies_in_holds_its_shard_and_the_next_group_is_the_one_read_next() -> None:
    order = ShardOrder((5, 3, 7, 2, 4, 6, 1), seed=3, shuffle_shards=3)
    positions = range(2 * order.samples + 5)  # across epochs
    for position in positions:
        current, following = order.groups_at(position)
        assert order.at(position).shard in current and len(current) <= 3
        # the first position whose group differs is in `following`
        later = next(p for p in range(position, position + order.samples + 1) if order.groups_at(p)[0] != current)
        assert order.groups_at(later)[0] == following
