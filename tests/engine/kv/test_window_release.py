"""Blocks released behind a sliding window (`BlockManager.release_behind`): the table keeps its
indexing (released entries read NULL_BLOCK), ref counts of shared blocks drop by one table, swap
moves only the blocks still held, the prefix cache never hands out a block the table let go."""

from __future__ import annotations

import pytest

from engine.kv.block_manager import BlockManager
from engine.kv.block_pool import NULL_BLOCK
from engine.kv.block_stats import block_tables

BS = 4


def manager(window: int = 6, num_blocks: int = 16, **kwargs: object) -> BlockManager:
    return BlockManager(num_blocks, BS, 8, watermark=0.0, window=window, **kwargs)  # type: ignore[arg-type]


def test_release_behind_the_first_query() -> None:
    """Window 6: a query at 13 sees 8..13, so block 0 (0..3) and block 1 (4..7) are released."""
    m = manager()
    m.allocate(1, list(range(14)))
    assert m.release_behind(1, 13) == 2
    table = m.block_table(1)
    assert table[:2] == [NULL_BLOCK, NULL_BLOCK] and NULL_BLOCK not in table[2:]
    assert m.num_live_blocks(1) == 2 and m.num_used_blocks == 2
    assert m.release_behind(1, 13) == 0  # idempotent
    assert m.slot(1, 13) == table[3] * BS + 1
    with pytest.raises(ValueError, match="released"):
        m.slot(1, 2)
    m.check_invariants()
    assert m.stats().released_blocks == 2
    m.free(1)
    m.check_invariants()
    assert m.num_used_blocks == 0


def test_the_block_holding_the_window_start_is_kept() -> None:
    """A query at 12 sees 7..12: block 1 holds position 7, so only block 0 goes."""
    m = manager()
    m.allocate(1, list(range(13)))
    assert m.release_behind(1, 12) == 1
    assert m.block_table(1)[1] != NULL_BLOCK


def test_no_window_releases_nothing() -> None:
    m = manager(window=0)
    m.allocate(1, list(range(40)))
    assert m.release_behind(1, 39) == 0
    assert NULL_BLOCK not in m.block_table(1)


def test_a_stream_stays_bounded_while_it_grows() -> None:
    """Decoding 200 tokens with window 16: never more than ceil(16 / 4) + 1 blocks held."""
    m = manager(window=16, num_blocks=8)
    m.allocate(1, [0])
    for position in range(1, 200):
        m.append_slot(1, position)
        m.release_behind(1, position)
        assert m.num_live_blocks(1) <= 16 // BS + 1
        m.check_invariants()
    assert len(m.block_table(1)) == 50  # indexing kept: position p is still in entry p // 4
    m.free(1)
    assert m.num_used_blocks == 0


def test_forks_share_and_release_each_their_own_reference() -> None:
    m = manager()
    m.allocate(1, list(range(14)))
    m.fork(1, 2)
    shared = m.block_table(1)[0]
    assert m.release_behind(1, 13) == 2
    assert m.blocks[shared].ref_count == 1  # still the child's
    m.check_invariants()
    m.fork(1, 3)  # a fork of a released table holds only the live blocks
    assert m.block_table(3)[:2] == [NULL_BLOCK, NULL_BLOCK]
    m.check_invariants()
    assert m.append_slot(3, 99) is not None  # shared partial last block: copied on write
    m.check_invariants()
    for seq_id in (1, 2, 3):
        m.free(seq_id)
    m.check_invariants()
    assert m.num_used_blocks == 0


def test_swap_moves_only_the_live_blocks() -> None:
    m = manager()
    m.allocate(1, list(range(14)))
    m.release_behind(1, 13)
    copies = m.swap_out([1])
    assert len(copies) == 2 and m.num_used_blocks == 0
    assert m.block_table(1)[:2] == [NULL_BLOCK, NULL_BLOCK]
    assert m.num_free_cpu_blocks == 6
    m.check_invariants()
    assert len(m.swap_in([1])) == 2
    assert m.block_table(1)[:2] == [NULL_BLOCK, NULL_BLOCK] and m.num_used_blocks == 2
    m.check_invariants()
    m.free(1)
    m.check_invariants()
    assert m.num_used_blocks == 0 and m.num_free_cpu_blocks == 8


def test_truncate_never_reaches_a_released_block() -> None:
    m = manager()
    m.allocate(1, list(range(14)))
    m.release_behind(1, 13)
    m.truncate(1, 13)  # a rejected speculative token: the tail only
    with pytest.raises(ValueError, match="released"):
        m.truncate(1, 5)


def test_prefix_cache_keeps_released_blocks_whole_or_not_at_all() -> None:
    """A released block keeps its cache entry while free (its K/V are exact); a later prompt hits
    the prefix only while every block of the chain is cached, and the sequence with released
    entries still publishes the blocks it holds behind them."""
    m = manager(enable_prefix_caching=True)
    tokens = list(range(14))
    m.allocate(1, tokens)
    m.mark_computed(1, 8)  # blocks 0 and 1 published
    m.release_behind(1, 13)
    m.mark_computed(1, 14)  # block 2 published behind the released ones
    m.check_invariants()
    assert m.num_cached_free_blocks == 2
    assert m.allocate(2, tokens) == 12  # the whole chain (0, 1 revived from the free list, 2 shared)
    m.check_invariants()
    m.free(2)
    m.free(1)
    m.allocate(3, list(range(100, 160)))  # 15 of 16 blocks: evicts the chain's head, not block 2
    assert len(m.cached) == 1
    m.free(3)
    assert m.allocate(4, tokens) == 0  # the chain's head is gone: no hit for what follows it
    m.check_invariants()


def test_block_tables_view_leaves_the_released_entries_out() -> None:
    m = manager()
    m.allocate(7, list(range(14)))
    m.release_behind(7, 13)
    (table,) = block_tables(m, [("req", 0, 7)])
    assert table["num_blocks"] == 2 and table["released"] == 2
    assert sum(count for _, count in table["runs"]) == 2
