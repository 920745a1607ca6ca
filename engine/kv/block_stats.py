"""The block manager's figures, and a compact run-length snapshot of the pool."""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from engine.kv.block_pool import PoolView

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
    window: int  # tokens a query sees in every layer when blocks behind it are released; 0: none are
    released_blocks: int  # table entries released behind the window so far

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "prefix_hit_rate": self.prefix_hit_rate}


def compute_stats(manager: PoolView) -> BlockStats:
    """Figures of a block manager; O(1), cheap enough for every step."""
    used = manager.num_used_blocks
    return BlockStats(
        block_size=manager.block_size,
        num_blocks=manager.num_blocks,
        num_free_blocks=manager.num_free_blocks,
        num_used_blocks=used,
        num_cached_free_blocks=manager.num_cached_free_blocks,
        usage_ratio=used / manager.num_blocks,
        block_utilization=manager.num_stored_tokens / (used * manager.block_size) if used else 0.0,
        num_cpu_blocks=manager.num_cpu_blocks,
        num_free_cpu_blocks=manager.num_free_cpu_blocks,
        num_seqs=len(manager.seqs),
        cow_copies=manager.cow_copies,
        prefix_queries=manager.prefix_queries,
        prefix_hits=manager.prefix_hits,
        swapped_out_blocks=manager.swapped_out_blocks,
        swapped_in_blocks=manager.swapped_in_blocks,
        window=manager.window,
        released_blocks=manager.released_blocks,
    )


def pool_snapshot(manager: PoolView) -> list[list[int]]:
    """Run-length encoded state of every device block: [[state, run_length], ...] with states
    FREE, USED, SHARED (ref count > 1) and CACHED (free but still a prefix-cache entry)."""
    runs: list[list[int]] = []
    for block in manager.blocks:
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


def block_id_runs(block_ids: list[int], max_runs: int) -> list[list[int]]:
    """Consecutive ids folded into [[first_id, count], ...], at most `max_runs` runs."""
    runs: list[list[int]] = []
    for block_id in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == block_id:
            runs[-1][1] += 1
        elif len(runs) < max_runs:
            runs.append([block_id, 1])
        else:
            break
    return runs


def block_tables(manager: PoolView, seqs: Iterable[tuple[str, int, int]], max_seqs: int = 64,
                 max_runs: int = 64) -> list[dict[str, Any]]:
    """Block tables of up to `max_seqs` sequences given as (request_id, sample index, seq_id):
    ``{"id", "index", "host" (swapped out: host block ids), "num_blocks", "runs", "released"}`` with
    the ids it holds run-length encoded, so a view of a 100k-block pool stays a few kilobytes;
    `released` counts the leading entries given back behind a sliding window (not in the runs)."""
    tables = []
    for request_id, index, seq_id in itertools.islice(seqs, max_seqs):
        entry = manager.seqs.get(seq_id)
        if entry is not None:
            live = entry.live_ids()
            tables.append({"id": request_id, "index": index, "host": entry.on_host, "num_blocks": len(live),
                           "runs": block_id_runs(live, max_runs), "released": entry.num_released})
    return tables
