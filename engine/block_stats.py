"""The block manager's figures, and a compact run-length snapshot of the pool."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.block_manager import BlockManager

# Pool snapshot states, one per device block.
FREE, USED, SHARED, CACHED = 0, 1, 2, 3


@dataclass(slots=True, frozen=True)
class BlockStats:
    """What the pool looks like right now, and what it has done so far."""

    block_size: int
    num_blocks: int
    num_free_blocks: int
    num_used_blocks: int
    num_cached_free_blocks: int
    usage_ratio: float
    block_utilization: float
    num_cpu_blocks: int
    num_free_cpu_blocks: int
    num_seqs: int
    cow_copies: int
    prefix_queries: int
    prefix_hits: int
    swapped_out_blocks: int
    swapped_in_blocks: int

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "prefix_hit_rate": self.prefix_hit_rate}


def compute_stats(bm: BlockManager) -> BlockStats:
    """Figures of a block manager; O(number of cached blocks), cheap enough for every step."""
    used = bm.num_used_blocks
    cached_free = sum(1 for block in bm.cached.values() if block.ref_count == 0)
    return BlockStats(
        block_size=bm.block_size,
        num_blocks=bm.num_blocks,
        num_free_blocks=bm.num_free_blocks,
        num_used_blocks=used,
        num_cached_free_blocks=cached_free,
        usage_ratio=used / bm.num_blocks,
        block_utilization=bm.num_stored_tokens / (used * bm.block_size) if used else 0.0,
        num_cpu_blocks=bm.num_cpu_blocks,
        num_free_cpu_blocks=bm.num_free_cpu_blocks,
        num_seqs=len(bm.seqs),
        cow_copies=bm.cow_copies,
        prefix_queries=bm.prefix_queries,
        prefix_hits=bm.prefix_hits,
        swapped_out_blocks=bm.swapped_out_blocks,
        swapped_in_blocks=bm.swapped_in_blocks,
    )


def pool_snapshot(bm: BlockManager) -> list[list[int]]:
    """Run-length encoded state of every device block: [[state, run_length], ...] with states
    FREE, USED, SHARED (ref count > 1) and CACHED (free but still a prefix-cache entry)."""
    runs: list[list[int]] = []
    for block in bm.blocks:
        if block.ref_count > 1:
            state = SHARED
        elif block.ref_count == 1:
            state = USED
        else:
            state = CACHED if block.hash is not None else FREE
        if runs and runs[-1][0] == state:
            runs[-1][1] += 1
        else:
            runs.append([state, 1])
    return runs
