"""The paged KV block manager: per-sequence block tables over a pool of device blocks and a
pool of host (swap) blocks, with on-demand allocation, copy-on-write forks, swapping and
prefix caching. Sequences are plain int ids; no tensor is touched here: the manager returns
the (src, dst) block copies the runner must perform.

With a sliding `window` (every attention layer of the model slides), the blocks of a sequence
that lie wholly behind the window of the step's first query go back to the pool
(`release_behind`); their table entries become `NULL_BLOCK`, so positions keep their blocks'
indices and the kernels, which never read entries before a query's window, take the tables
unchanged. A prompt is still allocated whole at admission; its blocks are released as its
chunks pass."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence

from common.log import get_logger
from engine.kv.block_invariants import check_invariants
from engine.kv.block_pool import NULL_BLOCK, Block, FreeBlockQueue, SeqBlocks, hash_block
from engine.kv.block_stats import BlockStats, compute_stats

log = get_logger("blocks")


class BlockManager:
    """Allocates, shares, copies-on-write, swaps and frees KV blocks for sequences."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_cpu_blocks: int = 0,
        *,
        watermark: float = 0.01,
        enable_prefix_caching: bool = False,
        debug: bool = False,
        window: int = 0,
    ) -> None:
        """`window`: the tokens a query sees (itself included) in every layer, so that the blocks
        behind it can be released; 0 when some layer attends its whole context (nothing is)."""
        if num_blocks < 1 or block_size < 1 or num_cpu_blocks < 0 or window < 0:
            raise ValueError("num_blocks and block_size must be >= 1, num_cpu_blocks and window >= 0")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_cpu_blocks = num_cpu_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.debug = debug
        self.window = window
        self.released_blocks = 0  # table entries released behind the window so far
        self.watermark_blocks = int(watermark * num_blocks)
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[int, Block] = {}
        self.cpu_ref = [0] * num_cpu_blocks
        self.cpu_tokens = [0] * num_cpu_blocks
        self.free_cpu: list[int] = list(range(num_cpu_blocks - 1, -1, -1))
        self.seqs: dict[int, SeqBlocks] = {}
        self.num_stored_tokens = 0
        self.num_cached_free_blocks = 0  # free blocks still holding a prefix-cache entry
        self.cow_copies = 0
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.swapped_out_blocks = 0
        self.swapped_in_blocks = 0

    # ----- figures -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    @property
    def num_free_cpu_blocks(self) -> int:
        return len(self.free_cpu)

    def stats(self) -> BlockStats:
        """Pool figures: free/used, usage ratio, block utilization, CoW copies, prefix hits."""
        return compute_stats(self)

    def block_table(self, seq_id: int) -> list[int]:
        return self.seqs[seq_id].block_ids

    def num_tokens(self, seq_id: int) -> int:
        return len(self.seqs[seq_id].token_ids)

    def has_seq(self, seq_id: int) -> bool:
        return seq_id in self.seqs

    def slot(self, seq_id: int, position: int) -> int:
        """The flat cache slot holding token `position` of a sequence."""
        block_id = self.seqs[seq_id].block_ids[position // self.block_size]
        if block_id == NULL_BLOCK:
            raise ValueError(f"position {position} of sequence {seq_id} lies in a block released behind the window")
        return block_id * self.block_size + position % self.block_size

    def num_live_blocks(self, seq_id: int) -> int:
        """Blocks a sequence holds (its table less the entries released behind the window)."""
        seq = self.seqs[seq_id]
        return len(seq.block_ids) - seq.num_released

    # ----- sliding window ------------------------------------------------------------------
    def release_behind(self, seq_id: int, first_position: int) -> int:
        """Release the blocks no query at `first_position` or later sees: those whose last token
        lies at or before `first_position - window` (a query at q sees q - window < p <= q).
        The caller passes the first position a step computes for the sequence, which never
        decreases (chunks advance; a speculative step's rollback keeps its first token), so no
        later step, swap or rollback needs a released block. Returns the blocks released.

            window 6, block size 4, first_position 13: keys 8.. are seen
            before   [3 | 5 | 8 | 9]        after   [NULL | 5 | 8 | 9]    (block 3 held 0..3)

        A shared block (forks, beams, prefix hits) loses only this table's reference; a hashed
        block keeps its prefix-cache entry in the free list (its K/V stay exact)."""
        if not self.window:
            return 0
        seq = self.seqs[seq_id]
        behind = max(0, first_position - self.window + 1) // self.block_size
        behind = min(behind, len(seq.block_ids) - 1)  # the block being written is never behind
        released = 0
        for i in range(seq.num_released, behind):
            block_id = seq.block_ids[i]
            if seq.on_host:
                self._drop_cpu_ref(block_id)
            else:
                self._drop_ref(self.blocks[block_id], seq_id)
            seq.block_ids[i] = NULL_BLOCK
            released += 1
        if released:
            seq.num_released = behind
            self.released_blocks += released
            self._event("release", seq=seq_id, num_blocks=released, first_position=first_position)
        return released

    # ----- allocation ----------------------------------------------------------------------
    def can_allocate(self, token_ids: Sequence[int], root: int | None = None) -> bool:
        """True when the prompt fits, after prefix hits, while keeping the watermark free (`root`:
        its first block's parent key, `common.block_hash.adapter_root`)."""
        need = self._num_blocks_for(len(token_ids)) - self._num_active_hits(token_ids, root)
        return self.num_free_blocks - need >= self.watermark_blocks

    def can_ever_allocate(self, num_tokens: int) -> bool:
        """False when the sequence could not fit even into an empty pool."""
        return self._num_blocks_for(num_tokens) <= self.num_blocks - self.watermark_blocks

    def allocate(self, seq_id: int, token_ids: Sequence[int], root: int | None = None) -> int:
        """Give every token of a new sequence a slot; returns the number of tokens whose K/V
        are already cached (whole blocks, always leaving at least one token to compute). Its
        blocks' keys chain from `root` (a LoRA adapter's: `common.block_hash.adapter_root`)."""
        if seq_id in self.seqs:
            raise ValueError(f"sequence {seq_id} already has blocks")
        seq = SeqBlocks(token_ids=list(token_ids), root=root)
        self.seqs[seq_id] = seq
        hits = self._take_cached_prefix(seq_id, seq) if self.enable_prefix_caching else 0
        remaining = len(token_ids) - hits * self.block_size
        while remaining > 0:
            block = self._take_free(seq_id)
            block.num_tokens = min(remaining, self.block_size)
            self.num_stored_tokens += block.num_tokens
            seq.block_ids.append(block.block_id)
            remaining -= block.num_tokens
        if self.enable_prefix_caching:
            self.prefix_queries += len(token_ids)
            self.prefix_hits += hits * self.block_size
        return hits * self.block_size

    def allocate_sharing(self, seq_id: int, token_ids: Sequence[int], donor_id: int, num_shared: int) -> None:
        """Give a new sequence the donor's first `num_shared` blocks (full blocks of the very same
        tokens, ref counts +1) and fresh blocks for the rest: a forked request recomputed without
        prefix caching shares its prompt again. The caller must not run the new sequence's
        tokens before the donor's K/V of the shared blocks is written."""
        donor = self.seqs[donor_id]
        shared = num_shared * self.block_size
        if donor.on_host or donor.num_released or len(donor.token_ids) < shared or len(token_ids) <= shared:
            raise ValueError(f"sequence {donor_id} cannot share {num_shared} blocks with a {len(token_ids)}-token one")
        if list(token_ids[:shared]) != donor.token_ids[:shared]:
            raise ValueError("shared blocks must hold the same tokens")
        if seq_id in self.seqs:
            raise ValueError(f"sequence {seq_id} already has blocks")
        seq = SeqBlocks(token_ids=list(token_ids), root=donor.root)
        self.seqs[seq_id] = seq
        for block_id in donor.block_ids[:num_shared]:
            self._add_ref(self.blocks[block_id], seq_id)
            seq.block_ids.append(block_id)
        remaining = len(token_ids) - shared
        while remaining > 0:
            block = self._take_free(seq_id)
            block.num_tokens = min(remaining, self.block_size)
            self.num_stored_tokens += block.num_tokens
            seq.block_ids.append(block.block_id)
            remaining -= block.num_tokens

    def can_append_slot(self, seq_id: int) -> bool:
        """True when one more token fits (a new block or a CoW copy may be needed)."""
        return self.num_append_blocks(seq_id) <= self.num_free_blocks

    def num_append_blocks(self, seq_id: int) -> int:
        """Blocks the next append_slot takes: 1 for a full or shared last block, else 0."""
        seq = self.seqs[seq_id]
        if len(seq.token_ids) % self.block_size == 0:
            return 1
        return 0 if self.blocks[seq.block_ids[-1]].ref_count == 1 else 1

    def can_append_slots(self, seq_ids: Sequence[int]) -> bool:
        """True when every listed sequence can take one more token at once."""
        return self.num_group_append_blocks(seq_ids) <= self.num_free_blocks

    def num_group_append_blocks(self, seq_ids: Sequence[int]) -> int:
        """Blocks one more token for each listed sequence takes, appended in turn (on device, or
        as they will be once swapped in): 1 after a full last block; for a partial last block
        shared by `r` sequences of which `k` are listed, min(k, r - 1) copies, since the last
        holder to append finds it no longer shared and writes in place. Two samples forked
        after a 17-token prompt (block size 8) need 1 block for their 18th tokens, not 2.
        A swapped-in group holds its host blocks alone (`swap_in` gives them fresh device
        blocks), so there `r` is the number of listed sequences."""
        need = 0
        sharers: Counter[tuple[bool, int]] = Counter()
        for seq_id in seq_ids:
            seq = self.seqs[seq_id]
            if len(seq.token_ids) % self.block_size == 0:
                need += 1
            elif seq.on_host or self.blocks[seq.block_ids[-1]].ref_count > 1:
                sharers[seq.on_host, seq.block_ids[-1]] += 1
        for (on_host, block_id), listed in sharers.items():
            holders = listed if on_host else self.blocks[block_id].ref_count
            need += min(listed, holders - 1)
        return need

    def append_slot(self, seq_id: int, token_id: int) -> tuple[int, int] | None:
        """Reserve the slot of one more token. Allocates when the last block is full; copies
        the last block on write when it is shared, returning the (src, dst) copy to perform.

        Copy-on-write of a shared last block (n = 2 samples forked after the prompt; block
        size 4, prompt of 6 tokens, `|` separates blocks, `r` is the ref count)::

            before   parent: [7 r2 | 9 r2: t4 t5 _ _ ]      child: [7 r2 | 9 r2]
            append_slot(child, x)   → 9 is shared: take 12, return (9, 12)
            after    parent: [7 r2 | 9 r1: t4 t5 _ _ ]      child: [7 r2 | 12 r1: t4 t5 x _]

        Block 12 gets the token count of 9 plus one; the runner copies 9's K/V rows into 12
        before the step writes slot 2 of block 12. Full blocks are never written again, so
        they stay shared (7 here) until every owner frees them."""
        seq = self.seqs[seq_id]
        seq.token_ids.append(token_id)
        if (len(seq.token_ids) - 1) % self.block_size == 0:
            block = self._take_free(seq_id)
            block.num_tokens = 1
            self.num_stored_tokens += 1
            seq.block_ids.append(block.block_id)
            return None
        last = self.blocks[seq.block_ids[-1]]
        if last.ref_count == 1:
            last.num_tokens += 1
            self.num_stored_tokens += 1
            return None
        copy = self._take_free(seq_id)
        copy.num_tokens = last.num_tokens + 1
        self.num_stored_tokens += copy.num_tokens
        self._drop_ref(last, seq_id)
        seq.block_ids[-1] = copy.block_id
        self.cow_copies += 1
        self._event("cow", src=last.block_id, dst=copy.block_id, seq=seq_id)
        return last.block_id, copy.block_id

    def num_blocks_to_grow(self, seq_id: int, count: int) -> int:
        """Blocks `count` more appends would take (a CoW copy of a shared last block counted)."""
        seq = self.seqs[seq_id]
        length = len(seq.token_ids)
        need = self._num_blocks_for(length + count) - self._num_blocks_for(length)
        if count and length % self.block_size and self.blocks[seq.block_ids[-1]].ref_count > 1:
            need += 1
        return need

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Cut a sequence back to its first `num_tokens` tokens (rejected speculative tokens):
        whole blocks past the end go back to the pool, the partial last block is kept.

            before   [a b c d | e f x y | z _ _ _]      truncate(seq, 6)
            after    [a b c d | e f _ _]               the third block is freed

        Only blocks past the prefix-cached ones may be cut (`mark_computed` hashes computed
        full blocks only, so a block hashed as full never holds a rejected token); the kept
        partial block must not be shared."""
        seq = self.seqs[seq_id]
        if seq.on_host:
            raise ValueError("cannot truncate a swapped-out sequence")
        if not 0 <= num_tokens <= len(seq.token_ids):
            raise ValueError(f"cannot truncate {len(seq.token_ids)} tokens to {num_tokens}")
        if num_tokens < len(seq.hashes) * self.block_size:
            raise ValueError("cannot truncate into a prefix-cached block")
        keep = self._num_blocks_for(num_tokens)
        if seq.num_released and keep <= seq.num_released:
            raise ValueError("cannot truncate into a block released behind the window")
        for block_id in reversed(seq.block_ids[keep:]):
            self._drop_ref(self.blocks[block_id], seq_id)
        del seq.block_ids[keep:]
        del seq.token_ids[num_tokens:]
        if keep:
            last = self.blocks[seq.block_ids[-1]]
            used = num_tokens - (keep - 1) * self.block_size
            if used != last.num_tokens:
                if last.ref_count > 1:
                    raise ValueError("cannot truncate into a shared block")
                self.num_stored_tokens += used - last.num_tokens
                last.num_tokens = used

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child shares every block of the parent (ref counts +1)."""
        parent = self.seqs[parent_id]
        if parent.on_host:
            raise ValueError("cannot fork a swapped-out sequence")
        if child_id in self.seqs:
            raise ValueError(f"sequence {child_id} already has blocks")
        self.seqs[child_id] = SeqBlocks(block_ids=list(parent.block_ids), token_ids=list(parent.token_ids),
                                        hashes=list(parent.hashes),
                                        num_released=parent.num_released, root=parent.root)
        for block_id in parent.live_ids():
            block = self.blocks[block_id]
            block.ref_count += 1
            self._event("ref", block=block_id, seq=child_id, ref_count=block.ref_count)

    def free(self, seq_id: int) -> None:
        """Release a sequence's blocks; last block first so tails are evicted before heads."""
        seq = self.seqs.pop(seq_id)
        if seq.on_host:
            for cpu_id in seq.live_ids():
                self._drop_cpu_ref(cpu_id)
            return
        for block_id in reversed(seq.live_ids()):
            self._drop_ref(self.blocks[block_id], seq_id)

    def mark_computed(self, seq_id: int, num_tokens: int) -> None:
        """Publish the full blocks among the first `num_tokens` (K/V now written) to the
        prefix cache, so later requests with the same prefix reuse them.

        Keys chain, so a block is found only behind the very same prefix::

            tokens   [a b c d | e f g h | i j]        (block size 4)
            keys     k0 = H(None, abcd)  k1 = H(k0, efgh)   (the partial block has none)

        A later prompt `abcd efgh xyz` finds k0 then k1 (two blocks, 8 tokens not recomputed);
        `zzzz efgh ...` finds nothing, although its second block holds the same tokens. A freed
        block keeps its key in the LRU free list until it is reused for something else."""
        if not self.enable_prefix_caching:
            return
        seq = self.seqs[seq_id]
        if seq.on_host:
            return
        num_full = min(num_tokens, len(seq.token_ids)) // self.block_size
        for i in range(len(seq.hashes), num_full):
            parent = seq.hashes[-1] if seq.hashes else seq.root
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            key = hash_block(parent, tokens)
            seq.hashes.append(key)
            if seq.block_ids[i] == NULL_BLOCK:  # released: the chain goes on, the block is not ours to publish
                continue
            block = self.blocks[seq.block_ids[i]]
            if block.hash is None and key not in self.cached:
                block.hash, block.parent_hash, block.token_ids = key, parent, tokens
                self.cached[key] = block

    def cached_keys(self, limit: int) -> list[int]:
        """Up to `limit` prefix-cache keys this pool holds, most recently used first: blocks in use
        (the latest cached first), then free cached blocks, the latest freed first (the next to
        be evicted come last). O(number of blocks): meant for a heartbeat, not every step."""
        if limit <= 0:
            return []
        keys = [key for key, block in reversed(self.cached.items()) if block.ref_count > 0][:limit]
        if len(keys) < limit:
            free = [block.hash for block in self.free_queue if block.hash is not None]
            keys.extend(reversed(free[-(limit - len(keys)):]))
        return keys

    def reset_prefix_cache(self) -> int:
        """Forget every prefix-cache entry of a free block (blocks in use keep theirs: their
        sequences still reference them); the number of blocks dropped. What vLLM's
        `reset_prefix_cache` does, e.g. so a benchmark times a prompt as a new one."""
        dropped = [block for block in self.cached.values() if block.ref_count == 0]
        for block in dropped:
            del self.cached[block.hash]  # type: ignore[arg-type]  # cached blocks have a hash
            block.forget_hash()
            block.num_tokens = 0
        self.num_cached_free_blocks -= len(dropped)
        return len(dropped)

    # ----- swapping ------------------------------------------------------------------------
    def can_swap_out(self, seq_ids: Sequence[int]) -> bool:
        return len(self._distinct_blocks(seq_ids)) <= len(self.free_cpu)

    def swap_out(self, seq_ids: Sequence[int]) -> list[tuple[int, int]]:
        """Move a group's blocks to host memory; shared blocks move once. Returns
        (device block, host block) copies to perform before the device blocks are reused.

        Swapping a group whose sequences share blocks (beams or samples of one request)::

            device   seq A: [3 | 5 | 8]     seq B: [3 | 5 | 9]      (3 and 5 have ref 2)
            host     seq A: [h0 | h1 | h2]  seq B: [h0 | h1 | h3]   copies: 3→h0 5→h1 8→h2 9→h3

        Sharing survives on the host (h0 and h1 have host ref 2), and `swap_in` maps each host
        block to one fresh device block, so the group comes back with the same sharing and
        every shared block is copied once each way."""
        mapping: dict[int, int] = {}
        for seq_id in seq_ids:
            seq = self.seqs[seq_id]
            table: list[int] = [NULL_BLOCK] * seq.num_released
            for block_id in seq.live_ids():
                if block_id not in mapping:
                    mapping[block_id] = self.free_cpu.pop()
                    self.cpu_tokens[mapping[block_id]] = self.blocks[block_id].num_tokens
                cpu_id = mapping[block_id]
                self.cpu_ref[cpu_id] += 1
                table.append(cpu_id)
            for block_id in reversed(seq.live_ids()):
                self._drop_ref(self.blocks[block_id], seq_id)
            seq.block_ids, seq.on_host = table, True
        self.swapped_out_blocks += len(mapping)
        for device_id, cpu_id in mapping.items():
            self._event("swap_out", block=device_id, host_block=cpu_id, seq=seq_ids[0], seqs=list(seq_ids))
        return list(mapping.items())

    def can_swap_in(self, seq_ids: Sequence[int]) -> bool:
        """Room, above the watermark, for the group's blocks plus one block per sequence to grow
        on; where even an empty pool could not hold that headroom, for the blocks plus only what
        the next token of each takes (`num_group_append_blocks`). A group that ran before it was
        swapped out therefore always fits an empty pool again: asking for the headroom there
        would leave it swapped out forever, and the waiting queue behind it."""
        blocks = len(self._distinct_blocks(seq_ids))
        need = blocks + len(seq_ids)
        if need > self.num_blocks - self.watermark_blocks:
            need = blocks + self.num_group_append_blocks(seq_ids)
        return self.num_free_blocks - need >= self.watermark_blocks

    def swap_in(self, seq_ids: Sequence[int]) -> list[tuple[int, int]]:
        """Bring a swapped group back into fresh device blocks. Returns (host, device) copies."""
        mapping: dict[int, int] = {}
        for seq_id in seq_ids:
            seq = self.seqs[seq_id]
            table: list[int] = [NULL_BLOCK] * seq.num_released
            for cpu_id in seq.live_ids():
                if cpu_id not in mapping:
                    block = self._take_free(seq_id)
                    block.num_tokens = self.cpu_tokens[cpu_id]
                    self.num_stored_tokens += block.num_tokens
                    mapping[cpu_id] = block.block_id
                else:
                    self._add_ref(self.blocks[mapping[cpu_id]], seq_id)
                table.append(mapping[cpu_id])
                self._drop_cpu_ref(cpu_id)
            seq.block_ids, seq.on_host, seq.hashes = table, False, []
        self.swapped_in_blocks += len(mapping)
        for cpu_id, device_id in mapping.items():
            self._event("swap_in", block=device_id, host_block=cpu_id, seq=seq_ids[0], seqs=list(seq_ids))
        return list(mapping.items())

    # ----- internals -----------------------------------------------------------------------
    def _num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _prefix_keys(self, token_ids: Sequence[int], root: int | None = None) -> list[int]:
        """Hashes of the leading full blocks that may be reused (never the whole prompt)."""
        keys: list[int] = []
        parent = root
        for i in range((len(token_ids) - 1) // self.block_size):
            tokens = tuple(token_ids[i * self.block_size : (i + 1) * self.block_size])
            block = self.cached.get(key := hash_block(parent, tokens))
            if block is None or block.token_ids != tokens or block.parent_hash != parent:
                break
            keys.append(key)
            parent = key
        return keys

    def _num_active_hits(self, token_ids: Sequence[int], root: int | None = None) -> int:
        if not self.enable_prefix_caching:
            return 0
        return sum(1 for key in self._prefix_keys(token_ids, root) if self.cached[key].ref_count > 0)

    def _take_cached_prefix(self, seq_id: int, seq: SeqBlocks) -> int:
        keys = self._prefix_keys(seq.token_ids, seq.root)
        for key in keys:
            block = self.cached[key]
            if block.ref_count == 0:
                self.free_queue.remove(block)
                self.num_cached_free_blocks -= 1
                self.num_stored_tokens += block.num_tokens
            self._add_ref(block, seq_id)
            seq.block_ids.append(block.block_id)
        seq.hashes = keys
        return len(keys)

    def _take_free(self, seq_id: int) -> Block:
        block = self.free_queue.popleft()
        if block.hash is not None:  # evict the LRU cached block
            del self.cached[block.hash]
            self.num_cached_free_blocks -= 1
            block.forget_hash()
        block.ref_count = 1
        self._event("allocate", block=block.block_id, seq=seq_id)
        return block

    def _add_ref(self, block: Block, seq_id: int) -> None:
        block.ref_count += 1
        self._event("ref", block=block.block_id, seq=seq_id, ref_count=block.ref_count)

    def _drop_ref(self, block: Block, seq_id: int) -> None:
        block.ref_count -= 1
        if block.ref_count > 0:
            self._event("ref", block=block.block_id, seq=seq_id, ref_count=block.ref_count)
            return
        self.num_stored_tokens -= block.num_tokens
        if block.hash is None:
            block.num_tokens = 0
        else:
            self.num_cached_free_blocks += 1
        self.free_queue.append(block)
        self._event("free", block=block.block_id, seq=seq_id)

    def _drop_cpu_ref(self, cpu_id: int) -> None:
        self.cpu_ref[cpu_id] -= 1
        if self.cpu_ref[cpu_id] == 0:
            self.cpu_tokens[cpu_id] = 0
            self.free_cpu.append(cpu_id)

    def _distinct_blocks(self, seq_ids: Sequence[int]) -> set[int]:
        return {b for seq_id in seq_ids for b in self.seqs[seq_id].live_ids()}

    def _event(self, kind: str, **fields: object) -> None:
        if self.debug:
            log.info(f"block.{kind}", t=time.time(), **fields)

    def check_invariants(self) -> None:
        """Raise AssertionError when the pool's bookkeeping is inconsistent."""
        check_invariants(self)
