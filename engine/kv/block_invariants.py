"""The block manager's consistency checks (debug mode and tests)."""

from __future__ import annotations

from collections import Counter

from engine.kv.block_pool import NULL_BLOCK, PoolView


def check_invariants(manager: PoolView) -> None:
    """free + used == total; every ref count equals the number of tables holding the block (released
    entries, NULL_BLOCK, only leading a table and only with a sliding window);
    no block both free and referenced; cache entries and token counts agree."""
    free = list(manager.free_queue)
    free_ids = {block.block_id for block in free}
    assert len(free_ids) == len(free) == manager.num_free_blocks, "free queue holds a block twice"
    device_refs: Counter[int] = Counter()
    host_refs: Counter[int] = Counter()
    for seq_id, seq in manager.seqs.items():
        assert len(seq.block_ids) == -(-len(seq.token_ids) // manager.block_size), f"seq {seq_id}: table size"
        live = seq.live_ids()
        assert all(b == NULL_BLOCK for b in seq.block_ids[:seq.num_released]), f"seq {seq_id}: released entries"
        assert NULL_BLOCK not in live, f"seq {seq_id}: a released entry past the leading ones"
        assert not seq.num_released or manager.window, f"seq {seq_id}: released blocks without a window"
        assert len(set(live)) == len(live), f"seq {seq_id} holds a block twice"
        (host_refs if seq.on_host else device_refs).update(live)
    for block in manager.blocks:
        assert block.ref_count == device_refs.get(block.block_id, 0), f"block {block.block_id} ref count"
        assert (block.ref_count == 0) == (block.block_id in free_ids), f"block {block.block_id} free/used"
        assert block.ref_count >= 0
    assert len(free_ids) + sum(1 for b in manager.blocks if b.ref_count > 0) == manager.num_blocks
    for key, block in manager.cached.items():
        assert block.hash == key, f"cache entry {key} points at block {block.block_id} with another hash"
    cached_free = sum(1 for block in free if block.hash is not None)
    assert cached_free == manager.num_cached_free_blocks, (
        f"cached free blocks {manager.num_cached_free_blocks} != {cached_free}")
    stored = sum(block.num_tokens for block in manager.blocks if block.ref_count > 0)
    assert stored == manager.num_stored_tokens, f"stored tokens {manager.num_stored_tokens} != {stored}"
    for cpu_id in range(manager.num_cpu_blocks):
        assert manager.cpu_ref[cpu_id] == host_refs.get(cpu_id, 0), f"host block {cpu_id} ref count"
    assert len(set(manager.free_cpu)) == len(manager.free_cpu)
    assert all(manager.cpu_ref[c] == 0 for c in manager.free_cpu), "host block both free and referenced"
    assert len(manager.free_cpu) + sum(1 for r in manager.cpu_ref if r > 0) == manager.num_cpu_blocks
