"""Direct tests for every path of the block manager: allocation, append, fork and
copy-on-write, swapping, prefix caching, watermark, figures, debug events, invariants."""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from engine.kv.block_manager import BlockManager
from engine.kv.block_pool import Block, FreeBlockQueue, hash_block
from engine.kv.block_stats import CACHED, FREE, SHARED, USED, pool_snapshot

BS = 4


def make(
    num_blocks: int = 16, num_cpu_blocks: int = 8, *, enable_prefix_caching: bool = False, debug: bool = False
) -> BlockManager:
    """A small manager with no watermark."""
    return BlockManager(
        num_blocks,
        BS,
        num_cpu_blocks,
        watermark=0.0,
        enable_prefix_caching=enable_prefix_caching,
        debug=debug,
    )


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


# ----- allocation ---------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 3, 4, 5, 8, 9, 17])
def test_allocate_takes_ceil_tokens_over_block_size(n: int) -> None:
    bm = make()
    assert bm.allocate(0, tokens(n)) == 0
    assert len(bm.block_table(0)) == -(-n // BS)
    assert bm.num_used_blocks == -(-n // BS)
    assert bm.num_free_blocks == 16 - -(-n // BS)
    assert bm.num_tokens(0) == n
    bm.check_invariants()


def test_allocate_empty_prompt_takes_no_block() -> None:
    bm = make()
    bm.allocate(0, [])
    assert bm.block_table(0) == []
    assert bm.append_slot(0, 7) is None
    assert len(bm.block_table(0)) == 1
    bm.check_invariants()


def test_allocate_twice_same_seq_rejected() -> None:
    bm = make()
    bm.allocate(0, tokens(3))
    with pytest.raises(ValueError):
        bm.allocate(0, tokens(3))


def test_constructor_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError):
        BlockManager(0, BS)
    with pytest.raises(ValueError):
        BlockManager(4, 0)
    with pytest.raises(ValueError):
        BlockManager(4, BS, -1)


def test_can_allocate_and_can_ever_allocate_bounds() -> None:
    bm = make(num_blocks=4)
    assert bm.can_allocate(tokens(16))
    assert not bm.can_allocate(tokens(17))
    assert bm.can_ever_allocate(16)
    assert not bm.can_ever_allocate(17)
    bm.allocate(0, tokens(9))  # 3 blocks
    assert bm.can_allocate(tokens(4))
    assert not bm.can_allocate(tokens(5))


def test_slot_maps_position_to_flat_cache_slot() -> None:
    bm = make()
    bm.allocate(9, tokens(2))  # takes block 0
    bm.allocate(0, tokens(6))  # blocks 1, 2
    table = bm.block_table(0)
    assert bm.slot(0, 0) == table[0] * BS
    assert bm.slot(0, 5) == table[1] * BS + 1


# ----- append -------------------------------------------------------------------------------
def test_append_slot_allocates_exactly_at_block_boundaries() -> None:
    bm = make()
    bm.allocate(0, tokens(1))
    for n in range(2, 14):
        before = len(bm.block_table(0))
        assert bm.can_append_slot(0)
        assert bm.append_slot(0, n) is None
        after = len(bm.block_table(0))
        assert after == before + (1 if (n - 1) % BS == 0 else 0), n
        assert after == -(-n // BS)
        bm.check_invariants()
    assert bm.num_tokens(0) == 13


def test_can_append_slot_false_when_pool_full_at_boundary() -> None:
    bm = make(num_blocks=2)
    bm.allocate(0, tokens(8))
    assert not bm.can_append_slot(0)
    bm.free(0)
    bm.allocate(0, tokens(7))
    assert bm.can_append_slot(0)  # room left in its last block
    bm.append_slot(0, 99)
    assert not bm.can_append_slot(0)


# ----- fork and copy-on-write ---------------------------------------------------------------
def test_fork_partial_last_block_append_both_makes_exactly_one_cow() -> None:
    bm = make()
    bm.allocate(0, tokens(10))  # 2 full blocks + a partial one holding 2 tokens
    parent_table = list(bm.block_table(0))
    bm.fork(0, 1)
    assert bm.block_table(1) == parent_table
    assert all(bm.blocks[b].ref_count == 2 for b in parent_table)
    used_before = bm.num_used_blocks

    cow = bm.append_slot(1, 100)
    assert cow is not None
    src, dst = cow
    assert src == parent_table[-1]
    assert dst not in parent_table
    assert bm.block_table(1) == [*parent_table[:-1], dst]
    assert bm.blocks[dst].num_tokens == 3
    assert bm.blocks[src].ref_count == 1 and bm.blocks[src].num_tokens == 2

    assert bm.append_slot(0, 200) is None  # the parent now owns its last block alone
    assert bm.block_table(0) == parent_table
    assert bm.blocks[src].num_tokens == 3

    assert bm.stats().cow_copies == 1
    assert bm.num_used_blocks == used_before + 1
    for b in parent_table[:-1]:  # every full block stays shared
        assert bm.blocks[b].ref_count == 2
    assert bm.block_table(0)[:2] == bm.block_table(1)[:2]
    bm.check_invariants()


def test_fork_full_last_block_append_allocates_without_cow() -> None:
    bm = make()
    bm.allocate(0, tokens(8))
    bm.fork(0, 1)
    assert bm.append_slot(0, 1) is None
    assert bm.append_slot(1, 2) is None
    assert bm.cow_copies == 0
    assert bm.block_table(0)[:2] == bm.block_table(1)[:2]
    assert bm.block_table(0)[2] != bm.block_table(1)[2]
    bm.check_invariants()


def test_fork_three_way_cow_until_last_owner() -> None:
    bm = make()
    bm.allocate(0, tokens(2))
    bm.fork(0, 1)
    bm.fork(0, 2)
    last = bm.block_table(0)[-1]
    assert bm.blocks[last].ref_count == 3
    assert bm.append_slot(1, 5) is not None
    assert bm.append_slot(2, 5) is not None
    assert bm.append_slot(0, 5) is None  # sole owner now
    assert bm.cow_copies == 2
    assert bm.block_table(0) == [last]
    bm.check_invariants()


def test_can_append_slot_needs_free_block_for_cow() -> None:
    bm = make(num_blocks=1)
    bm.allocate(0, tokens(2))
    bm.fork(0, 1)
    assert not bm.can_append_slot(1)
    bm.free(1)
    assert bm.can_append_slot(0)


def test_fork_rejects_existing_child_and_swapped_parent() -> None:
    bm = make()
    bm.allocate(0, tokens(3))
    bm.allocate(1, tokens(3))
    with pytest.raises(ValueError):
        bm.fork(0, 1)
    bm.swap_out([0])
    with pytest.raises(ValueError):
        bm.fork(0, 2)


def test_free_releases_only_unshared_blocks() -> None:
    bm = make()
    bm.allocate(0, tokens(6))
    bm.fork(0, 1)
    bm.free(0)
    assert bm.num_used_blocks == 2
    assert all(bm.blocks[b].ref_count == 1 for b in bm.block_table(1))
    bm.free(1)
    assert bm.num_used_blocks == 0
    assert bm.num_free_blocks == 16
    assert bm.num_stored_tokens == 0
    assert not bm.has_seq(0) and not bm.has_seq(1)
    bm.check_invariants()


# ----- swapping -----------------------------------------------------------------------------
def test_swap_out_and_in_round_trip() -> None:
    bm = make(num_blocks=16, num_cpu_blocks=8)
    bm.allocate(0, tokens(10))  # 3 blocks
    old_table = list(bm.block_table(0))
    assert bm.can_swap_out([0])
    out = bm.swap_out([0])
    assert len(out) == 3
    assert [dev for dev, _ in out] == old_table
    assert len({host for _, host in out}) == 3
    assert bm.block_table(0) == [host for _, host in out]
    assert bm.num_used_blocks == 0
    assert bm.num_free_cpu_blocks == 5
    bm.check_invariants()

    bm.allocate(5, tokens(10, start=50))  # takes device blocks meanwhile
    assert bm.can_swap_in([0])
    back = bm.swap_in([0])
    assert len(back) == 3
    assert [host for host, _ in back] == [host for _, host in out]
    new_table = [dev for _, dev in back]
    assert bm.block_table(0) == new_table
    assert not set(new_table) & set(bm.block_table(5))
    assert [bm.blocks[b].num_tokens for b in new_table] == [4, 4, 2]
    assert bm.num_free_cpu_blocks == 8
    assert bm.stats().swapped_out_blocks == 3 and bm.stats().swapped_in_blocks == 3
    bm.append_slot(0, 77)
    assert bm.num_tokens(0) == 11
    bm.check_invariants()


def test_swap_in_takes_fresh_device_blocks_never_old_ids() -> None:
    # The freed ids go to the back of the free queue, so fresh blocks differ from the old ones.
    bm = make(num_blocks=8, num_cpu_blocks=8)
    bm.allocate(0, tokens(8))
    old_table = list(bm.block_table(0))
    bm.swap_out([0])
    back = bm.swap_in([0])
    assert not {dev for _, dev in back} & set(old_table)
    bm.check_invariants()


def test_swap_group_shared_blocks_move_once() -> None:
    bm = make(num_blocks=16, num_cpu_blocks=8)
    bm.allocate(0, tokens(10))  # 3 blocks, last partial
    bm.fork(0, 1)
    bm.append_slot(1, 100)  # CoW: 2 shared full blocks + one private last block each
    distinct = set(bm.block_table(0)) | set(bm.block_table(1))
    assert len(distinct) == 4
    out = bm.swap_out([0, 1])
    assert len(out) == 4
    assert {dev for dev, _ in out} == distinct
    assert bm.num_free_cpu_blocks == 4
    assert bm.block_table(0)[:2] == bm.block_table(1)[:2]  # still shared on the host
    assert all(bm.cpu_ref[h] == 2 for h in bm.block_table(0)[:2])
    assert bm.num_used_blocks == 0
    bm.check_invariants()

    back = bm.swap_in([0, 1])
    assert len(back) == 4
    assert bm.block_table(0)[:2] == bm.block_table(1)[:2]
    assert all(bm.blocks[b].ref_count == 2 for b in bm.block_table(0)[:2])
    assert bm.num_used_blocks == 4 and bm.num_free_cpu_blocks == 8
    bm.check_invariants()


def test_swap_out_partial_group_keeps_other_owner_on_device() -> None:
    bm = make()
    bm.allocate(0, tokens(6))
    bm.fork(0, 1)
    out = bm.swap_out([1])
    assert len(out) == 2
    assert all(bm.blocks[b].ref_count == 1 for b in bm.block_table(0))
    bm.check_invariants()
    bm.swap_in([1])
    assert not set(bm.block_table(0)) & set(bm.block_table(1))
    bm.check_invariants()


def test_can_swap_out_false_when_host_pool_too_small() -> None:
    bm = make(num_blocks=16, num_cpu_blocks=2)
    bm.allocate(0, tokens(12))  # 3 blocks
    assert not bm.can_swap_out([0])
    bm.allocate(1, tokens(8))
    assert bm.can_swap_out([1])
    bm.fork(1, 2)
    assert bm.can_swap_out([1, 2])  # shared blocks count once


def test_can_swap_in_false_when_device_pool_too_small() -> None:
    bm = make(num_blocks=4, num_cpu_blocks=8)
    bm.allocate(0, tokens(12))  # 3 blocks
    bm.swap_out([0])
    bm.allocate(1, tokens(4))
    assert not bm.can_swap_in([0])  # 3 blocks + 1 to grow > 3 free
    bm.free(1)
    assert bm.can_swap_in([0])


def test_free_swapped_sequence_returns_host_blocks() -> None:
    bm = make()
    bm.allocate(0, tokens(6))
    bm.fork(0, 1)
    bm.swap_out([0, 1])
    bm.free(0)
    assert bm.num_free_cpu_blocks == 6
    bm.free(1)
    assert bm.num_free_cpu_blocks == 8
    assert bm.num_used_blocks == 0
    bm.check_invariants()


# ----- prefix caching -----------------------------------------------------------------------
def prefix_bm(num_blocks: int = 16) -> BlockManager:
    return make(num_blocks=num_blocks, enable_prefix_caching=True)


def test_prefix_hits_only_after_mark_computed() -> None:
    bm = prefix_bm()
    prompt = tokens(10)
    assert bm.allocate(0, prompt) == 0
    assert bm.allocate(1, prompt) == 0  # not computed yet: no hit
    bm.mark_computed(0, 10)
    assert bm.allocate(2, prompt) == 8  # two whole blocks
    assert bm.block_table(2)[:2] == bm.block_table(0)[:2]
    assert bm.block_table(2)[2] != bm.block_table(0)[2]
    assert all(bm.blocks[b].ref_count == 2 for b in bm.block_table(0)[:2])
    bm.check_invariants()


def test_prefix_partial_mark_computed_hits_only_computed_blocks() -> None:
    bm = prefix_bm()
    bm.allocate(0, tokens(12))
    bm.mark_computed(0, 7)  # only block 0 is fully written
    assert bm.allocate(1, tokens(12)) == 4


def test_prefix_hit_never_covers_whole_prompt() -> None:
    bm = prefix_bm()
    prompt = tokens(8)
    bm.allocate(0, prompt)
    bm.mark_computed(0, 8)
    assert bm.allocate(1, prompt) == 4  # last token always computed
    assert bm.block_table(1)[0] == bm.block_table(0)[0]
    assert bm.block_table(1)[1] != bm.block_table(0)[1]
    bm.check_invariants()


def test_prefix_chained_hash_same_block_after_other_prefix_misses() -> None:
    bm = prefix_bm()
    bm.allocate(0, [1, 1, 1, 1, 2, 2, 2, 2, 9])
    bm.mark_computed(0, 9)
    # Same second block tokens, different first block: neither block may hit.
    assert bm.allocate(1, [3, 3, 3, 3, 2, 2, 2, 2, 9]) == 0
    assert not set(bm.block_table(1)) & set(bm.block_table(0))
    assert hash_block(None, (1, 1, 1, 1)) != hash_block(None, (3, 3, 3, 3))
    h1, h3 = hash_block(None, (1,) * 4), hash_block(None, (3,) * 4)
    assert hash_block(h1, (2,) * 4) != hash_block(h3, (2,) * 4)


def test_prefix_lru_revival_of_freed_cached_block() -> None:
    bm = prefix_bm(num_blocks=8)
    prompt = tokens(9)
    bm.allocate(0, prompt)
    bm.mark_computed(0, 9)
    cached_ids = bm.block_table(0)[:2]
    bm.free(0)
    assert bm.num_used_blocks == 0
    assert bm.stats().num_cached_free_blocks == 2
    bm.allocate(1, tokens(3, start=100))  # takes an uncached free block, not a cached one
    assert bm.block_table(1)[0] not in cached_ids
    assert bm.allocate(2, prompt) == 8
    assert bm.block_table(2)[:2] == cached_ids
    assert all(bm.blocks[b] not in bm.free_queue for b in cached_ids)
    assert bm.num_free_blocks == 8 - 1 - 3
    bm.check_invariants()


def test_prefix_cached_free_blocks_count_as_free_for_can_allocate() -> None:
    bm = prefix_bm(num_blocks=4)
    bm.allocate(0, tokens(16))
    bm.mark_computed(0, 16)
    bm.free(0)
    assert bm.num_free_blocks == 4
    assert bm.can_allocate(tokens(16, start=100))
    bm.allocate(1, tokens(16, start=100))  # evicts every cached block
    assert bm.cached == {}
    bm.check_invariants()


def test_prefix_can_allocate_counts_active_hits_as_free() -> None:
    bm = prefix_bm(num_blocks=4)
    bm.allocate(0, tokens(9))  # 3 blocks
    bm.mark_computed(0, 9)
    assert not bm.can_allocate(tokens(9, start=100))  # needs 3, 1 free
    assert bm.can_allocate(tokens(9))  # shares 2 running blocks, needs 1


def test_prefix_eviction_takes_least_recently_freed_cached_block() -> None:
    bm = prefix_bm(num_blocks=4)
    a, b = [1] * 4 + [0], [2] * 4 + [0]
    bm.allocate(0, a)
    bm.allocate(1, b)
    bm.mark_computed(0, 5)
    bm.mark_computed(1, 5)
    a_block, b_block = bm.block_table(0)[0], bm.block_table(1)[0]
    bm.free(0)  # a's blocks freed first: least recently freed
    bm.free(1)
    # Free queue now: a_tail, a_block, b_tail, b_block; a request needing 2 blocks (no hit)
    # takes a_tail and a_block, evicting a's cached entry but keeping b's.
    bm.allocate(2, tokens(8, start=100))
    assert a_block in bm.block_table(2)
    assert bm.allocate(3, b) == 4  # b still cached
    assert bm.block_table(3)[0] == b_block
    bm.free(2)
    assert bm.allocate(5, a) == 0  # a was evicted
    bm.check_invariants()


def test_prefix_queries_and_hits_figures() -> None:
    bm = prefix_bm()
    bm.allocate(0, tokens(10))
    bm.mark_computed(0, 10)
    bm.allocate(1, tokens(10))
    bm.allocate(2, tokens(6, start=50))
    stats = bm.stats()
    assert stats.prefix_queries == 26
    assert stats.prefix_hits == 8
    assert stats.prefix_hit_rate == pytest.approx(8 / 26)
    assert stats.to_dict()["prefix_hit_rate"] == pytest.approx(8 / 26)


def test_prefix_caching_off_never_hits_or_counts() -> None:
    bm = make()
    bm.allocate(0, tokens(10))
    bm.mark_computed(0, 10)
    assert bm.allocate(1, tokens(10)) == 0
    assert bm.cached == {}
    assert bm.stats().prefix_queries == 0


def test_prefix_fork_and_swap_keep_cache_consistent() -> None:
    bm = prefix_bm()
    prompt = tokens(9)
    bm.allocate(0, prompt)
    bm.mark_computed(0, 9)
    bm.fork(0, 1)
    bm.swap_out([0, 1])
    bm.check_invariants()
    assert bm.allocate(2, prompt) == 8  # cached blocks stay valid on the device
    bm.swap_in([0, 1])
    bm.mark_computed(0, 9)
    bm.check_invariants()
    for seq_id in (0, 1, 2):
        bm.free(seq_id)
    assert bm.num_used_blocks == 0
    bm.check_invariants()


# ----- watermark ----------------------------------------------------------------------------
def test_watermark_blocks_admission() -> None:
    bm = BlockManager(100, BS, watermark=0.05)
    assert bm.watermark_blocks == 5
    assert bm.can_allocate(tokens(95 * BS))
    assert not bm.can_allocate(tokens(95 * BS + 1))
    assert not bm.can_ever_allocate(95 * BS + 1)
    bm.allocate(0, tokens(90 * BS))
    assert not bm.can_allocate(tokens(5 * BS + 1))
    assert bm.can_append_slot(0)  # running sequences may grow into the watermark


def test_watermark_blocks_swap_in() -> None:
    bm = BlockManager(100, BS, 100, watermark=0.1)
    bm.allocate(0, tokens(40 * BS))
    bm.swap_out([0])
    bm.allocate(1, tokens(50 * BS))
    assert not bm.can_swap_in([0])  # 50 free - (40 + 1) < 10
    bm.free(1)
    bm.allocate(1, tokens(49 * BS))
    assert bm.can_swap_in([0])


# ----- figures ------------------------------------------------------------------------------
def test_stats_usage_ratio_and_block_utilization_hand_computed() -> None:
    bm = make(num_blocks=10)
    empty = bm.stats()
    assert empty.usage_ratio == 0.0 and empty.block_utilization == 0.0
    bm.allocate(0, tokens(5))  # 2 blocks, 5 tokens
    bm.allocate(1, tokens(8))  # 2 blocks, 8 tokens
    stats = bm.stats()
    assert stats.num_used_blocks == 4 and stats.num_free_blocks == 6
    assert stats.usage_ratio == pytest.approx(0.4)
    assert stats.block_utilization == pytest.approx(13 / 16)
    assert stats.num_seqs == 2
    bm.fork(0, 2)  # shared blocks store their tokens once
    assert bm.stats().block_utilization == pytest.approx(13 / 16)
    bm.append_slot(2, 1)  # CoW: a 2-token copy of the 1-token last block
    stats = bm.stats()
    assert stats.num_used_blocks == 5
    assert stats.block_utilization == pytest.approx(15 / 20)
    assert stats.cow_copies == 1


def test_stats_host_pool_figures() -> None:
    bm = make(num_blocks=10, num_cpu_blocks=6)
    bm.allocate(0, tokens(9))
    bm.swap_out([0])
    stats = bm.stats()
    assert stats.num_cpu_blocks == 6 and stats.num_free_cpu_blocks == 3
    assert stats.num_used_blocks == 0 and stats.block_utilization == 0.0


def test_pool_snapshot_run_length_encoding() -> None:
    bm = BlockManager(8, BS, enable_prefix_caching=True, watermark=0.0)
    assert pool_snapshot(bm) == [[FREE, 8]]
    bm.allocate(0, tokens(9))  # blocks 0, 1, 2
    bm.fork(0, 1)  # 0..2 shared
    bm.allocate(2, tokens(2, start=50))  # block 3
    assert pool_snapshot(bm) == [[SHARED, 3], [USED, 1], [FREE, 4]]
    bm.mark_computed(0, 9)  # blocks 0 and 1 cached
    bm.free(0)
    bm.free(1)
    assert pool_snapshot(bm) == [[CACHED, 2], [FREE, 1], [USED, 1], [FREE, 4]]


# ----- debug events -------------------------------------------------------------------------
def test_debug_events_cover_the_block_lifecycle() -> None:
    bm = make(num_blocks=8, num_cpu_blocks=8, debug=True)
    with capture_logs() as events:
        bm.allocate(0, tokens(5))
        bm.fork(0, 1)
        bm.append_slot(1, 9)
        bm.swap_out([1])
        bm.swap_in([1])
        bm.free(0)
        bm.free(1)
    kinds = [e["event"] for e in events]
    for kind in ("block.allocate", "block.ref", "block.cow", "block.swap_out", "block.swap_in", "block.free"):
        assert kind in kinds, kind
    for event in events:
        assert isinstance(event["t"], float)
        assert "seq" in event
        assert "block" in event or {"src", "dst"} <= event.keys()
    swaps = [e for e in events if e["event"] in ("block.swap_out", "block.swap_in")]
    assert all("host_block" in e for e in swaps) and len(swaps) == 4  # two blocks out, two back
    allocs = [e for e in events if e["event"] == "block.allocate"]
    assert [(e["block"], e["seq"]) for e in allocs[:2]] == [(0, 0), (1, 0)]
    (cow,) = [e for e in events if e["event"] == "block.cow"]
    assert (cow["src"], cow["seq"]) == (1, 1)
    refs = [e for e in events if e["event"] == "block.ref" and e["seq"] == 1]
    assert [(e["block"], e["ref_count"]) for e in refs[:2]] == [(0, 2), (1, 2)]
    frees = [e for e in events if e["event"] == "block.free"]
    assert sum(1 for e in frees if e["seq"] == 0) >= 1
    assert {e["block"] for e in frees} >= set(range(3))


def test_debug_off_logs_nothing() -> None:
    bm = make()
    with capture_logs() as events:
        bm.allocate(0, tokens(5))
        bm.free(0)
    assert events == []


# ----- invariants ---------------------------------------------------------------------------
def corruptible() -> BlockManager:
    bm = make()
    bm.allocate(0, tokens(6))
    bm.fork(0, 1)
    bm.allocate(2, tokens(3))
    bm.check_invariants()
    return bm


def test_check_invariants_catches_wrong_ref_count() -> None:
    bm = corruptible()
    bm.blocks[bm.block_table(0)[0]].ref_count = 1
    with pytest.raises(AssertionError):
        bm.check_invariants()


def test_check_invariants_catches_block_free_and_referenced() -> None:
    bm = corruptible()
    bm.free_queue.append(bm.blocks[bm.block_table(2)[0]])
    with pytest.raises(AssertionError):
        bm.check_invariants()


def test_check_invariants_catches_leaked_block() -> None:
    bm = corruptible()
    bm.free_queue.popleft()
    with pytest.raises(AssertionError):
        bm.check_invariants()


def test_check_invariants_catches_short_table_and_stored_tokens() -> None:
    bm = corruptible()
    bm.seqs[2].token_ids.extend(range(4))
    with pytest.raises(AssertionError):
        bm.check_invariants()
    bm = corruptible()
    bm.num_stored_tokens += 1
    with pytest.raises(AssertionError):
        bm.check_invariants()


def test_check_invariants_catches_host_pool_corruption() -> None:
    bm = corruptible()
    bm.swap_out([2])
    bm.check_invariants()
    bm.cpu_ref[bm.block_table(2)[0]] += 1
    with pytest.raises(AssertionError):
        bm.check_invariants()


# ----- free queue ---------------------------------------------------------------------------
def test_free_block_queue_order_and_remove_from_middle() -> None:
    blocks = [Block(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    assert len(queue) == 5 and [b.block_id for b in queue] == [0, 1, 2, 3, 4]
    queue.remove(blocks[2])
    assert blocks[2] not in queue and blocks[3] in queue
    assert [b.block_id for b in queue] == [0, 1, 3, 4]
    queue.remove(blocks[4])  # tail end
    queue.remove(blocks[0])  # head end
    assert [b.block_id for b in queue] == [1, 3]
    queue.append(blocks[0])
    assert [b.block_id for b in queue] == [1, 3, 0]
    assert queue.popleft() is blocks[1]
    assert queue.popleft() is blocks[3]
    assert queue.popleft() is blocks[0]
    assert len(queue) == 0
    with pytest.raises(IndexError):
        queue.popleft()
    with pytest.raises(AssertionError):
        queue.remove(blocks[0])


def test_free_block_queue_ops_are_constant_time() -> None:
    """Removing from the middle of a large queue touches only the neighbours."""
    blocks = [Block(i) for i in range(100_000)]
    queue = FreeBlockQueue(blocks)
    middle = blocks[50_000]
    queue.remove(middle)
    assert blocks[49_999].next is blocks[50_001] and blocks[50_001].prev is blocks[49_999]
    assert middle.prev is None and middle.next is None and len(queue) == 99_999
    queue.append(middle)
    assert blocks[-1].next is middle and len(queue) == 100_000
