"""Exact tests of the block pool and block tables on an 11-block pool."""

from __future__ import annotations

import pytest

from metronome.kv.block_pool import BlockPool
from metronome.kv.block_table import BlockTable
from metronome.kv.residency import ResidencyPolicy


def test_allocate_is_all_or_nothing_and_fifo():
    pool = BlockPool(11)
    assert pool.allocate(4) == [0, 1, 2, 3]
    assert pool.allocate(8) is None  # only 7 left: nothing taken
    assert pool.num_free_blocks == 7
    pool.free([1, 2])
    assert pool.allocate(7) == [4, 5, 6, 7, 8, 9, 10]
    assert pool.allocate(2) == [1, 2]  # freed blocks are reused last-in-line
    assert pool.num_free_blocks == 0 and pool.num_used_blocks == 11


def test_double_free_is_a_bug():
    pool = BlockPool(11)
    ids = pool.allocate(2)
    pool.free(ids)
    with pytest.raises(AssertionError):
        pool.free(ids[:1])


def test_window_table_slides_block_by_block():
    pool = BlockPool(11)
    table = BlockTable(ResidencyPolicy.sinks_window(2, 6), block_size=4)
    assert table.append(15, pool)  # positions 0..14 -> logical blocks 0..3
    assert table.block_ids == [0, 1, 2, 3]
    # next query at 15 sees window from block(15 - 6 + 1 = 10) = block 2 -> block 1 goes
    assert table.slide(pool) == 1
    assert list(table.logical_to_block_id) == [0, 2, 3]
    assert table.num_pinned_blocks == 1
    assert table.resident_tokens == 2 + (15 - 8)  # sinks + window positions 8..14
    assert table.append(1, pool) and table.block_ids == [0, 2, 3]  # position 15 fits block 3
    assert table.append(1, pool) and table.block_ids == [0, 2, 3, 4]
    table.release(pool)
    assert pool.num_used_blocks == 0


def test_unbounded_table_never_slides():
    pool = BlockPool(11)
    table = BlockTable(ResidencyPolicy.unbounded(), block_size=4)
    assert table.append(40, pool) and table.slide(pool) == 0
    assert table.resident_tokens == 40
    assert not table.append(5, pool)  # 44 slots, 45 needed: the pool is dry, nothing changed
    assert table.num_tokens == 40 and pool.num_free_blocks == 1


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("unbounded", ResidencyPolicy.unbounded()),
        ("window:512", ResidencyPolicy.window(512)),
        ("sinks_window:4:512@rolling", ResidencyPolicy.sinks_window(4, 512, "rolling")),
    ],
)
def test_policy_parse_round_trips(text, expected):
    assert ResidencyPolicy.parse(text) == expected
    assert ResidencyPolicy.parse(str(expected)) == expected


@pytest.mark.parametrize("bad", ["window", "window:0", "sinks_window:4", "lru:3", "window:x",
                                 "window:8@sideways", "unbounded@rolling"])
def test_policy_parse_rejects_with_a_clear_error(bad):
    with pytest.raises(ValueError, match="policy|Positions|window|unbounded"):
        ResidencyPolicy.parse(bad)
