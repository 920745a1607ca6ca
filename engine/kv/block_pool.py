"""Physical KV blocks and the free list: an intrusive doubly linked list with O(1) pop,
append and remove-from-middle. Freed blocks keep their prefix hash and sit in LRU order
until they are reused, so a later request with the same prefix can revive them.

Also the per-sequence table (`SeqBlocks`) and `PoolView`, the read-only face of a block manager
that its figures (`block_stats`) and consistency checks (`block_invariants`) read, so neither
imports the manager."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from common.block_hash import hash_block

__all__ = ["NULL_BLOCK", "Block", "FreeBlockQueue", "PoolView", "SeqBlocks", "hash_block"]

# The table entry of a block released behind a sliding window (`BlockManager.release_behind`): the
# kernels never read the entries of blocks wholly before every query's window.
NULL_BLOCK = -1


@dataclass(slots=True, eq=False)
class Block:
    """One physical block of KV slots. No tensor lives here: the id indexes the cache."""

    block_id: int
    ref_count: int = 0
    num_tokens: int = 0
    hash: int | None = None
    parent_hash: int | None = None
    token_ids: tuple[int, ...] = ()
    prev: Block | None = field(default=None, repr=False)
    next: Block | None = field(default=None, repr=False)

    def forget_hash(self) -> None:
        self.hash = None
        self.parent_hash = None
        self.token_ids = ()


class FreeBlockQueue:
    """Free blocks, least recently freed first. Membership is `block.prev is not None`."""

    def __init__(self, blocks: list[Block]) -> None:
        self._head = Block(-1)
        self._tail = Block(-1)
        self._head.next = self._tail
        self._tail.prev = self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Block]:
        node = self._head.next
        while node is not None and node is not self._tail:
            yield node
            node = node.next

    def __contains__(self, block: Block) -> bool:
        return block.prev is not None

    def append(self, block: Block) -> None:
        """Put a block at the most-recently-freed end."""
        last = self._tail.prev
        assert last is not None and block.prev is None
        block.prev, block.next = last, self._tail
        last.next = block
        self._tail.prev = block
        self._len += 1

    def popleft(self) -> Block:
        """Take the least recently freed block."""
        block = self._head.next
        if block is None or block is self._tail:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: Block) -> None:
        """Unlink a block from anywhere in the queue (prefix-cache revival)."""
        prev, nxt = block.prev, block.next
        assert prev is not None and nxt is not None, "block is not in the free queue"
        prev.next = nxt
        nxt.prev = prev
        block.prev = block.next = None
        self._len -= 1


@dataclass(slots=True, kw_only=True)
class SeqBlocks:
    """One sequence's block table (device ids, or host ids while swapped) and its tokens."""

    block_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)  # chained hashes of its leading full blocks
    on_host: bool = False
    num_released: int = 0  # leading entries released behind a sliding window (NULL_BLOCK)
    root: int | None = None  # parent key of its first block (`common.block_hash.adapter_root`)

    def live_ids(self) -> list[int]:
        """The block ids it holds: its table past the released entries."""
        return self.block_ids[self.num_released:]


class PoolView(Protocol):
    """What a block manager shows of its pools to its figures and its consistency checks."""

    @property
    def block_size(self) -> int: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def num_cpu_blocks(self) -> int: ...
    @property
    def num_free_blocks(self) -> int: ...
    @property
    def num_used_blocks(self) -> int: ...
    @property
    def num_free_cpu_blocks(self) -> int: ...
    @property
    def num_cached_free_blocks(self) -> int: ...
    @property
    def num_stored_tokens(self) -> int: ...
    @property
    def blocks(self) -> list[Block]: ...
    @property
    def free_queue(self) -> FreeBlockQueue: ...
    @property
    def cached(self) -> Mapping[int, Block]: ...
    @property
    def seqs(self) -> Mapping[int, SeqBlocks]: ...
    @property
    def cpu_ref(self) -> list[int]: ...
    @property
    def free_cpu(self) -> list[int]: ...
    @property
    def cow_copies(self) -> int: ...
    @property
    def prefix_queries(self) -> int: ...
    @property
    def prefix_hits(self) -> int: ...
    @property
    def swapped_out_blocks(self) -> int: ...
    @property
    def swapped_in_blocks(self) -> int: ...
    @property
    def window(self) -> int: ...
    @property
    def released_blocks(self) -> int: ...
