"""The block manager's consistency checks (debug mode and tests)."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.kv.block_manager import BlockManager


def check_invariants(bm: BlockManager) -> None:
    """free + used == total; every ref count equals the number of tables holding the block;
    no block both free and referenced; cache entries and token counts agree."""
    free = list(bm.free_queue)
    free_ids = {block.block_id for block in free}
    assert len(free_ids) == len(free) == bm.num_free_blocks, "free queue holds a block twice"
    device_refs: Counter[int] = Counter()
    host_refs: Counter[int] = Counter()
    for seq_id, seq in bm.seqs.items():
        assert len(seq.block_ids) == -(-len(seq.token_ids) // bm.block_size), f"seq {seq_id}: table size"
        assert len(set(seq.block_ids)) == len(seq.block_ids), f"seq {seq_id} holds a block twice"
        (host_refs if seq.on_host else device_refs).update(seq.block_ids)
    for block in bm.blocks:
        assert block.ref_count == device_refs.get(block.block_id, 0), f"block {block.block_id} ref count"
        assert (block.ref_count == 0) == (block.block_id in free_ids), f"block {block.block_id} free/used"
        assert block.ref_count >= 0
    assert len(free_ids) + sum(1 for b in bm.blocks if b.ref_count > 0) == bm.num_blocks
    for key, block in bm.cached.items():
        assert block.hash == key, f"cache entry {key} points at block {block.block_id} with another hash"
    cached_free = sum(1 for block in free if block.hash is not None)
    assert cached_free == bm.num_cached_free_blocks, f"cached free blocks {bm.num_cached_free_blocks} != {cached_free}"
    stored = sum(block.num_tokens for block in bm.blocks if block.ref_count > 0)
    assert stored == bm.num_stored_tokens, f"stored tokens {bm.num_stored_tokens} != {stored}"
    for cpu_id in range(bm.num_cpu_blocks):
        assert bm.cpu_ref[cpu_id] == host_refs.get(cpu_id, 0), f"host block {cpu_id} ref count"
    assert len(set(bm.free_cpu)) == len(bm.free_cpu)
    assert all(bm.cpu_ref[c] == 0 for c in bm.free_cpu), "host block both free and referenced"
    assert len(bm.free_cpu) + sum(1 for r in bm.cpu_ref if r > 0) == bm.num_cpu_blocks
