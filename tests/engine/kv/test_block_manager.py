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
    manager = make()
    assert manager.allocate(0, tokens(n)) == 0
    assert len(manager.block_table(0)) == -(-n // BS)
    assert manager.num_used_blocks == -(-n // BS)
    assert manager.num_free_blocks == 16 - -(-n // BS)
    assert manager.num_tokens(0) == n
    manager.check_invariants()


def test_allocate_empty_prompt_takes_no_block() -> None:
    manager = make()
    manager.allocate(0, [])
    assert manager.block_table(0) == []
    assert manager.append_slot(0, 7) is None
    assert len(manager.block_table(0)) == 1
    manager.check_invariants()


def test_allocate_twice_same_seq_rejected() -> None:
    manager = make()
    manager.allocate(0, tokens(3))
    with pytest.raises(ValueError):
        manager.allocate(0, tokens(3))


def test_constructor_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError):
        BlockManager(0, BS)
    with pytest.raises(ValueError):
        BlockManager(4, 0)
    with pytest.raises(ValueError):
        BlockManager(4, BS, -1)


def test_can_allocate_and_can_ever_allocate_bounds() -> None:
    manager = make(num_blocks=4)
    assert manager.can_allocate(tokens(16))
    assert not manager.can_allocate(tokens(17))
    assert manager.can_ever_allocate(16)
    assert not manager.can_ever_allocate(17)
    manager.allocate(0, tokens(9))  # 3 blocks
    assert manager.can_allocate(tokens(4))
    assert not manager.can_allocate(tokens(5))


def test_slot_maps_position_to_flat_cache_slot() -> None:
    manager = make()
    manager.allocate(9, tokens(2))  # takes block 0
    manager.allocate(0, tokens(6))  # blocks 1, 2
    table = manager.block_table(0)
    assert manager.slot(0, 0) == table[0] * BS
    assert manager.slot(0, 5) == table[1] * BS + 1


# ----- append -------------------------------------------------------------------------------
def test_append_slot_allocates_exactly_at_block_boundaries() -> None:
    manager = make()
    manager.allocate(0, tokens(1))
    for n in range(2, 14):
        before = len(manager.block_table(0))
        assert manager.can_append_slot(0)
        assert manager.append_slot(0, n) is None
        after = len(manager.block_table(0))
        assert after == before + (1 if (n - 1) % BS == 0 else 0), n
        assert after == -(-n // BS)
        manager.check_invariants()
    assert manager.num_tokens(0) == 13


def test_can_append_slot_false_when_pool_full_at_boundary() -> None:
    manager = make(num_blocks=2)
    manager.allocate(0, tokens(8))
    assert not manager.can_append_slot(0)
    manager.free(0)
    manager.allocate(0, tokens(7))
    assert manager.can_append_slot(0)  # room left in its last block
    manager.append_slot(0, 99)
    assert not manager.can_append_slot(0)


# ----- fork and copy-on-write ---------------------------------------------------------------
def test_fork_partial_last_block_append_both_makes_exactly_one_cow() -> None:
    manager = make()
    manager.allocate(0, tokens(10))  # 2 full blocks + a partial one holding 2 tokens
    parent_table = list(manager.block_table(0))
    manager.fork(0, 1)
    assert manager.block_table(1) == parent_table
    assert all(manager.blocks[b].ref_count == 2 for b in parent_table)
    used_before = manager.num_used_blocks

    cow = manager.append_slot(1, 100)
    assert cow is not None
    src, dst = cow
    assert src == parent_table[-1]
    assert dst not in parent_table
    assert manager.block_table(1) == [*parent_table[:-1], dst]
    assert manager.blocks[dst].num_tokens == 3
    assert manager.blocks[src].ref_count == 1 and manager.blocks[src].num_tokens == 2

    assert manager.append_slot(0, 200) is None  # the parent now owns its last block alone
    assert manager.block_table(0) == parent_table
    assert manager.blocks[src].num_tokens == 3

    assert manager.stats().cow_copies == 1
    assert manager.num_used_blocks == used_before + 1
    for b in parent_table[:-1]:  # every full block stays shared
        assert manager.blocks[b].ref_count == 2
    assert manager.block_table(0)[:2] == manager.block_table(1)[:2]
    manager.check_invariants()


def test_fork_full_last_block_append_allocates_without_cow() -> None:
    manager = make()
    manager.allocate(0, tokens(8))
    manager.fork(0, 1)
    assert manager.append_slot(0, 1) is None
    assert manager.append_slot(1, 2) is None
    assert manager.cow_copies == 0
    assert manager.block_table(0)[:2] == manager.block_table(1)[:2]
    assert manager.block_table(0)[2] != manager.block_table(1)[2]
    manager.check_invariants()


def test_fork_three_way_cow_until_last_owner() -> None:
    manager = make()
    manager.allocate(0, tokens(2))
    manager.fork(0, 1)
    manager.fork(0, 2)
    last = manager.block_table(0)[-1]
    assert manager.blocks[last].ref_count == 3
    assert manager.append_slot(1, 5) is not None
    assert manager.append_slot(2, 5) is not None
    assert manager.append_slot(0, 5) is None  # sole owner now
    assert manager.cow_copies == 2
    assert manager.block_table(0) == [last]
    manager.check_invariants()


def test_can_append_slot_needs_free_block_for_cow() -> None:
    manager = make(num_blocks=1)
    manager.allocate(0, tokens(2))
    manager.fork(0, 1)
    assert not manager.can_append_slot(1)
    manager.free(1)
    assert manager.can_append_slot(0)


def test_fork_rejects_existing_child_and_swapped_parent() -> None:
    manager = make()
    manager.allocate(0, tokens(3))
    manager.allocate(1, tokens(3))
    with pytest.raises(ValueError):
        manager.fork(0, 1)
    manager.swap_out([0])
    with pytest.raises(ValueError):
        manager.fork(0, 2)


def test_free_releases_only_unshared_blocks() -> None:
    manager = make()
    manager.allocate(0, tokens(6))
    manager.fork(0, 1)
    manager.free(0)
    assert manager.num_used_blocks == 2
    assert all(manager.blocks[b].ref_count == 1 for b in manager.block_table(1))
    manager.free(1)
    assert manager.num_used_blocks == 0
    assert manager.num_free_blocks == 16
    assert manager.num_stored_tokens == 0
    assert not manager.has_seq(0) and not manager.has_seq(1)
    manager.check_invariants()


# ----- swapping -----------------------------------------------------------------------------
def test_swap_out_and_in_round_trip() -> None:
    manager = make(num_blocks=16, num_cpu_blocks=8)
    manager.allocate(0, tokens(10))  # 3 blocks
    old_table = list(manager.block_table(0))
    assert manager.can_swap_out([0])
    out = manager.swap_out([0])
    assert len(out) == 3
    assert [dev for dev, _ in out] == old_table
    assert len({host for _, host in out}) == 3
    assert manager.block_table(0) == [host for _, host in out]
    assert manager.num_used_blocks == 0
    assert manager.num_free_cpu_blocks == 5
    manager.check_invariants()

    manager.allocate(5, tokens(10, start=50))  # takes device blocks meanwhile
    assert manager.can_swap_in([0])
    back = manager.swap_in([0])
    assert len(back) == 3
    assert [host for host, _ in back] == [host for _, host in out]
    new_table = [dev for _, dev in back]
    assert manager.block_table(0) == new_table
    assert not set(new_table) & set(manager.block_table(5))
    assert [manager.blocks[b].num_tokens for b in new_table] == [4, 4, 2]
    assert manager.num_free_cpu_blocks == 8
    assert manager.stats().swapped_out_blocks == 3 and manager.stats().swapped_in_blocks == 3
    manager.append_slot(0, 77)
    assert manager.num_tokens(0) == 11
    manager.check_invariants()


def test_swap_in_takes_fresh_device_blocks_never_old_ids() -> None:
    # The freed ids go to the back of the free queue, so fresh blocks differ from the old ones.
    manager = make(num_blocks=8, num_cpu_blocks=8)
    manager.allocate(0, tokens(8))
    old_table = list(manager.block_table(0))
    manager.swap_out([0])
    back = manager.swap_in([0])
    assert not {dev for _, dev in back} & set(old_table)
    manager.check_invariants()


def test_swap_group_shared_blocks_move_once() -> None:
    manager = make(num_blocks=16, num_cpu_blocks=8)
    manager.allocate(0, tokens(10))  # 3 blocks, last partial
    manager.fork(0, 1)
    manager.append_slot(1, 100)  # CoW: 2 shared full blocks + one private last block each
    distinct = set(manager.block_table(0)) | set(manager.block_table(1))
    assert len(distinct) == 4
    out = manager.swap_out([0, 1])
    assert len(out) == 4
    assert {dev for dev, _ in out} == distinct
    assert manager.num_free_cpu_blocks == 4
    assert manager.block_table(0)[:2] == manager.block_table(1)[:2]  # still shared on the host
    assert all(manager.cpu_ref[h] == 2 for h in manager.block_table(0)[:2])
    assert manager.num_used_blocks == 0
    manager.check_invariants()

    back = manager.swap_in([0, 1])
    assert len(back) == 4
    assert manager.block_table(0)[:2] == manager.block_table(1)[:2]
    assert all(manager.blocks[b].ref_count == 2 for b in manager.block_table(0)[:2])
    assert manager.num_used_blocks == 4 and manager.num_free_cpu_blocks == 8
    manager.check_invariants()


def test_swap_out_partial_group_keeps_other_owner_on_device() -> None:
    manager = make()
    manager.allocate(0, tokens(6))
    manager.fork(0, 1)
    out = manager.swap_out([1])
    assert len(out) == 2
    assert all(manager.blocks[b].ref_count == 1 for b in manager.block_table(0))
    manager.check_invariants()
    manager.swap_in([1])
    assert not set(manager.block_table(0)) & set(manager.block_table(1))
    manager.check_invariants()


def test_can_swap_out_false_when_host_pool_too_small() -> None:
    manager = make(num_blocks=16, num_cpu_blocks=2)
    manager.allocate(0, tokens(12))  # 3 blocks
    assert not manager.can_swap_out([0])
    manager.allocate(1, tokens(8))
    assert manager.can_swap_out([1])
    manager.fork(1, 2)
    assert manager.can_swap_out([1, 2])  # shared blocks count once


def test_can_swap_in_false_when_device_pool_too_small() -> None:
    manager = make(num_blocks=4, num_cpu_blocks=8)
    manager.allocate(0, tokens(12))  # 3 blocks
    manager.swap_out([0])
    manager.allocate(1, tokens(4))
    assert not manager.can_swap_in([0])  # 3 blocks + 1 to grow > 3 free
    manager.free(1)
    assert manager.can_swap_in([0])


def test_free_swapped_sequence_returns_host_blocks() -> None:
    manager = make()
    manager.allocate(0, tokens(6))
    manager.fork(0, 1)
    manager.swap_out([0, 1])
    manager.free(0)
    assert manager.num_free_cpu_blocks == 6
    manager.free(1)
    assert manager.num_free_cpu_blocks == 8
    assert manager.num_used_blocks == 0
    manager.check_invariants()


# ----- prefix caching -----------------------------------------------------------------------
def prefix_bm(num_blocks: int = 16) -> BlockManager:
    return make(num_blocks=num_blocks, enable_prefix_caching=True)


def test_prefix_hits_only_after_mark_computed() -> None:
    manager = prefix_bm()
    prompt = tokens(10)
    assert manager.allocate(0, prompt) == 0
    assert manager.allocate(1, prompt) == 0  # not computed yet: no hit
    manager.mark_computed(0, 10)
    assert manager.allocate(2, prompt) == 8  # two whole blocks
    assert manager.block_table(2)[:2] == manager.block_table(0)[:2]
    assert manager.block_table(2)[2] != manager.block_table(0)[2]
    assert all(manager.blocks[b].ref_count == 2 for b in manager.block_table(0)[:2])
    manager.check_invariants()


def test_reset_prefix_cache_drops_free_entries_only() -> None:
    """Free cached blocks forget their prefix (the next same prompt is computed in full); blocks a
    running sequence holds keep theirs, so a prompt sharing them still hits."""
    manager = prefix_bm()
    held, dropped = tokens(10), [t + 100 for t in tokens(10)]
    manager.allocate(0, held)
    manager.mark_computed(0, 10)
    manager.allocate(1, dropped)
    manager.mark_computed(1, 10)
    manager.free(1)
    assert manager.num_cached_free_blocks == 2
    assert manager.reset_prefix_cache() == 2
    manager.check_invariants()
    assert manager.num_cached_free_blocks == 0
    assert manager.allocate(2, dropped) == 0
    assert manager.allocate(3, held) == 8  # sequence 0 still holds its two full blocks
    assert manager.reset_prefix_cache() == 0
    for seq_id in (0, 2, 3):
        manager.free(seq_id)
    manager.check_invariants()
    assert manager.num_free_blocks == manager.num_blocks


def test_prefix_partial_mark_computed_hits_only_computed_blocks() -> None:
    manager = prefix_bm()
    manager.allocate(0, tokens(12))
    manager.mark_computed(0, 7)  # only block 0 is fully written
    assert manager.allocate(1, tokens(12)) == 4


def test_prefix_hit_never_covers_whole_prompt() -> None:
    manager = prefix_bm()
    prompt = tokens(8)
    manager.allocate(0, prompt)
    manager.mark_computed(0, 8)
    assert manager.allocate(1, prompt) == 4  # last token always computed
    assert manager.block_table(1)[0] == manager.block_table(0)[0]
    assert manager.block_table(1)[1] != manager.block_table(0)[1]
    manager.check_invariants()


def test_prefix_chained_hash_same_block_after_other_prefix_misses() -> None:
    manager = prefix_bm()
    manager.allocate(0, [1, 1, 1, 1, 2, 2, 2, 2, 9])
    manager.mark_computed(0, 9)
    # Same second block tokens, different first block: neither block may hit.
    assert manager.allocate(1, [3, 3, 3, 3, 2, 2, 2, 2, 9]) == 0
    assert not set(manager.block_table(1)) & set(manager.block_table(0))
    assert hash_block(None, (1, 1, 1, 1)) != hash_block(None, (3, 3, 3, 3))
    h1, h3 = hash_block(None, (1,) * 4), hash_block(None, (3,) * 4)
    assert hash_block(h1, (2,) * 4) != hash_block(h3, (2,) * 4)


def test_prefix_lru_revival_of_freed_cached_block() -> None:
    manager = prefix_bm(num_blocks=8)
    prompt = tokens(9)
    manager.allocate(0, prompt)
    manager.mark_computed(0, 9)
    cached_ids = manager.block_table(0)[:2]
    manager.free(0)
    assert manager.num_used_blocks == 0
    assert manager.stats().num_cached_free_blocks == 2
    manager.allocate(1, tokens(3, start=100))  # takes an uncached free block, not a cached one
    assert manager.block_table(1)[0] not in cached_ids
    assert manager.allocate(2, prompt) == 8
    assert manager.block_table(2)[:2] == cached_ids
    assert all(manager.blocks[b] not in manager.free_queue for b in cached_ids)
    assert manager.num_free_blocks == 8 - 1 - 3
    manager.check_invariants()


def test_prefix_cached_free_blocks_count_as_free_for_can_allocate() -> None:
    manager = prefix_bm(num_blocks=4)
    manager.allocate(0, tokens(16))
    manager.mark_computed(0, 16)
    manager.free(0)
    assert manager.num_free_blocks == 4
    assert manager.can_allocate(tokens(16, start=100))
    manager.allocate(1, tokens(16, start=100))  # evicts every cached block
    assert manager.cached == {}
    manager.check_invariants()


def test_prefix_can_allocate_counts_active_hits_as_free() -> None:
    manager = prefix_bm(num_blocks=4)
    manager.allocate(0, tokens(9))  # 3 blocks
    manager.mark_computed(0, 9)
    assert not manager.can_allocate(tokens(9, start=100))  # needs 3, 1 free
    assert manager.can_allocate(tokens(9))  # shares 2 running blocks, needs 1


def test_prefix_eviction_takes_least_recently_freed_cached_block() -> None:
    manager = prefix_bm(num_blocks=4)
    a, b = [1] * 4 + [0], [2] * 4 + [0]
    manager.allocate(0, a)
    manager.allocate(1, b)
    manager.mark_computed(0, 5)
    manager.mark_computed(1, 5)
    a_block, b_block = manager.block_table(0)[0], manager.block_table(1)[0]
    manager.free(0)  # a's blocks freed first: least recently freed
    manager.free(1)
    # Free queue now: a_tail, a_block, b_tail, b_block; a request needing 2 blocks (no hit)
    # takes a_tail and a_block, evicting a's cached entry but keeping b's.
    manager.allocate(2, tokens(8, start=100))
    assert a_block in manager.block_table(2)
    assert manager.allocate(3, b) == 4  # b still cached
    assert manager.block_table(3)[0] == b_block
    manager.free(2)
    assert manager.allocate(5, a) == 0  # a was evicted
    manager.check_invariants()


def test_prefix_queries_and_hits_figures() -> None:
    manager = prefix_bm()
    manager.allocate(0, tokens(10))
    manager.mark_computed(0, 10)
    manager.allocate(1, tokens(10))
    manager.allocate(2, tokens(6, start=50))
    stats = manager.stats()
    assert stats.prefix_queries == 26
    assert stats.prefix_hits == 8
    assert stats.prefix_hit_rate == pytest.approx(8 / 26)
    assert stats.to_dict()["prefix_hit_rate"] == pytest.approx(8 / 26)


def test_prefix_caching_off_never_hits_or_counts() -> None:
    manager = make()
    manager.allocate(0, tokens(10))
    manager.mark_computed(0, 10)
    assert manager.allocate(1, tokens(10)) == 0
    assert manager.cached == {}
    assert manager.stats().prefix_queries == 0


def test_prefix_fork_and_swap_keep_cache_consistent() -> None:
    manager = prefix_bm()
    prompt = tokens(9)
    manager.allocate(0, prompt)
    manager.mark_computed(0, 9)
    manager.fork(0, 1)
    manager.swap_out([0, 1])
    manager.check_invariants()
    assert manager.allocate(2, prompt) == 8  # cached blocks stay valid on the device
    manager.swap_in([0, 1])
    manager.mark_computed(0, 9)
    manager.check_invariants()
    for seq_id in (0, 1, 2):
        manager.free(seq_id)
    assert manager.num_used_blocks == 0
    manager.check_invariants()


# ----- watermark ----------------------------------------------------------------------------
def test_watermark_blocks_admission() -> None:
    manager = BlockManager(100, BS, watermark=0.05)
    assert manager.watermark_blocks == 5
    assert manager.can_allocate(tokens(95 * BS))
    assert not manager.can_allocate(tokens(95 * BS + 1))
    assert not manager.can_ever_allocate(95 * BS + 1)
    manager.allocate(0, tokens(90 * BS))
    assert not manager.can_allocate(tokens(5 * BS + 1))
    assert manager.can_append_slot(0)  # running sequences may grow into the watermark


def test_watermark_blocks_swap_in() -> None:
    manager = BlockManager(100, BS, 100, watermark=0.1)
    manager.allocate(0, tokens(40 * BS))
    manager.swap_out([0])
    manager.allocate(1, tokens(50 * BS))
    assert not manager.can_swap_in([0])  # 50 free - (40 + 1) < 10
    manager.free(1)
    manager.allocate(1, tokens(49 * BS))
    assert manager.can_swap_in([0])


# ----- figures ------------------------------------------------------------------------------
def test_stats_usage_ratio_and_block_utilization_hand_computed() -> None:
    manager = make(num_blocks=10)
    empty = manager.stats()
    assert empty.usage_ratio == 0.0 and empty.block_utilization == 0.0
    manager.allocate(0, tokens(5))  # 2 blocks, 5 tokens
    manager.allocate(1, tokens(8))  # 2 blocks, 8 tokens
    stats = manager.stats()
    assert stats.num_used_blocks == 4 and stats.num_free_blocks == 6
    assert stats.usage_ratio == pytest.approx(0.4)
    assert stats.block_utilization == pytest.approx(13 / 16)
    assert stats.num_seqs == 2
    manager.fork(0, 2)  # shared blocks store their tokens once
    assert manager.stats().block_utilization == pytest.approx(13 / 16)
    manager.append_slot(2, 1)  # CoW: a 2-token copy of the 1-token last block
    stats = manager.stats()
    assert stats.num_used_blocks == 5
    assert stats.block_utilization == pytest.approx(15 / 20)
    assert stats.cow_copies == 1


def test_stats_host_pool_figures() -> None:
    manager = make(num_blocks=10, num_cpu_blocks=6)
    manager.allocate(0, tokens(9))
    manager.swap_out([0])
    stats = manager.stats()
    assert stats.num_cpu_blocks == 6 and stats.num_free_cpu_blocks == 3
    assert stats.num_used_blocks == 0 and stats.block_utilization == 0.0


def test_pool_snapshot_run_length_encoding() -> None:
    manager = BlockManager(8, BS, enable_prefix_caching=True, watermark=0.0)
    assert pool_snapshot(manager) == [[FREE, 8]]
    manager.allocate(0, tokens(9))  # blocks 0, 1, 2
    manager.fork(0, 1)  # 0..2 shared
    manager.allocate(2, tokens(2, start=50))  # block 3
    assert pool_snapshot(manager) == [[SHARED, 3], [USED, 1], [FREE, 4]]
    manager.mark_computed(0, 9)  # blocks 0 and 1 cached
    manager.free(0)
    manager.free(1)
    assert pool_snapshot(manager) == [[CACHED, 2], [FREE, 1], [USED, 1], [FREE, 4]]


# ----- debug events -------------------------------------------------------------------------
def test_debug_events_cover_the_block_lifecycle() -> None:
    manager = make(num_blocks=8, num_cpu_blocks=8, debug=True)
    with capture_logs() as events:
        manager.allocate(0, tokens(5))
        manager.fork(0, 1)
        manager.append_slot(1, 9)
        manager.swap_out([1])
        manager.swap_in([1])
        manager.free(0)
        manager.free(1)
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
    manager = make()
    with capture_logs() as events:
        manager.allocate(0, tokens(5))
        manager.free(0)
    assert events == []


# ----- invariants ---------------------------------------------------------------------------
def corruptible() -> BlockManager:
    manager = make()
    manager.allocate(0, tokens(6))
    manager.fork(0, 1)
    manager.allocate(2, tokens(3))
    manager.check_invariants()
    return manager


def test_check_invariants_catches_wrong_ref_count() -> None:
    manager = corruptible()
    manager.blocks[manager.block_table(0)[0]].ref_count = 1
    with pytest.raises(AssertionError):
        manager.check_invariants()


def test_check_invariants_catches_block_free_and_referenced() -> None:
    manager = corruptible()
    manager.free_queue.append(manager.blocks[manager.block_table(2)[0]])
    with pytest.raises(AssertionError):
        manager.check_invariants()


def test_check_invariants_catches_leaked_block() -> None:
    manager = corruptible()
    manager.free_queue.popleft()
    with pytest.raises(AssertionError):
        manager.check_invariants()


def test_check_invariants_catches_short_table_and_stored_tokens() -> None:
    manager = corruptible()
    manager.seqs[2].token_ids.extend(range(4))
    with pytest.raises(AssertionError):
        manager.check_invariants()
    manager = corruptible()
    manager.num_stored_tokens += 1
    with pytest.raises(AssertionError):
        manager.check_invariants()


def test_check_invariants_catches_host_pool_corruption() -> None:
    manager = corruptible()
    manager.swap_out([2])
    manager.check_invariants()
    manager.cpu_ref[manager.block_table(2)[0]] += 1
    with pytest.raises(AssertionError):
        manager.check_invariants()


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


def test_prefix_keys_are_the_same_in_every_process() -> None:
    """Block keys do not depend on PYTHONHASHSEED: engines agree on what a prefix is."""
    import os
    import subprocess
    import sys

    code = "from engine.kv.block_pool import hash_block as h; print(h(h(None, (1, 2, 3)), (4, 5, 6)))"
    keys = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout.strip() for seed in ("1", "2")}
    assert keys == {str(hash_block(hash_block(None, (1, 2, 3)), (4, 5, 6)))}
    assert hash_block(None, (1, 2, 3)) != hash_block(None, (1, 2, 4)) != hash_block(7, (1, 2, 4))


# ----- truncate (rejected speculative tokens) -----------------------------------------------
@pytest.mark.parametrize(("length", "cut"), [(10, 6), (10, 8), (10, 9), (12, 4), (9, 1), (7, 7), (5, 0)])
def test_truncate_frees_whole_blocks_and_keeps_the_partial_last(length: int, cut: int) -> None:
    manager = make()
    manager.allocate(0, tokens(4))
    for t in range(4, length):
        manager.append_slot(0, t)
    table = list(manager.block_table(0))
    manager.truncate(0, cut)
    keep = -(-cut // BS)
    assert manager.block_table(0) == table[:keep]
    assert manager.num_tokens(0) == cut
    assert manager.num_used_blocks == keep
    assert manager.num_stored_tokens == cut
    manager.check_invariants()
    for t in range(cut, length + 3):  # regrows like a sequence that was never longer
        manager.append_slot(0, 100 + t)
    assert manager.num_stored_tokens == length + 3
    manager.check_invariants()
    manager.free(0)
    assert manager.num_used_blocks == 0
    manager.check_invariants()


def test_truncate_never_hashes_rejected_tokens() -> None:
    manager = prefix_bm()
    manager.allocate(0, tokens(6))
    manager.mark_computed(0, 6)  # block 0 cached
    for t in (50, 51, 52, 53, 54):  # 11 tokens: 6 computed + 5 proposals (block 1 fills with 2 rejected)
        manager.append_slot(0, t)
    manager.truncate(0, 7)  # accepted one: [0..3 | 4 5 50]
    manager.mark_computed(0, 7)
    assert len(manager.cached) == 1
    manager.append_slot(0, 60)  # the real token at position 7
    manager.mark_computed(0, 8)
    assert len(manager.cached) == 2
    manager.check_invariants()
    assert manager.allocate(1, [*tokens(6), 50, 60, 1]) == 8  # hashed with the accepted tokens
    assert manager.allocate(2, [*tokens(6), 50, 51, 1]) == 4  # never with the rejected ones
    manager.check_invariants()


def test_truncate_refuses_cached_blocks_swapped_and_out_of_range() -> None:
    manager = prefix_bm()
    manager.allocate(0, tokens(9))
    manager.mark_computed(0, 9)
    with pytest.raises(ValueError):
        manager.truncate(0, 7)  # block 1 is in the prefix cache
    with pytest.raises(ValueError):
        manager.truncate(0, 10)
    manager.truncate(0, 8)
    manager.check_invariants()
    manager.swap_out([0])
    with pytest.raises(ValueError):
        manager.truncate(0, 8)


def test_num_blocks_to_grow_counts_new_blocks_and_cow() -> None:
    manager = make()
    manager.allocate(0, tokens(3))
    assert manager.num_blocks_to_grow(0, 0) == 0
    assert manager.num_blocks_to_grow(0, 1) == 0
    assert manager.num_blocks_to_grow(0, 2) == 1
    assert manager.num_blocks_to_grow(0, 6) == 2
    manager.fork(0, 1)  # the partial last block is shared now: the first append copies it
    assert manager.num_blocks_to_grow(0, 1) == 1
    assert manager.num_blocks_to_grow(0, 2) == 2
    before, expected = manager.num_free_blocks, manager.num_blocks_to_grow(1, 5)
    for t in range(5):
        manager.append_slot(1, t)
    assert before - manager.num_free_blocks == expected == 2  # the copy of the shared block, one new block
    manager.check_invariants()
