"""The paged policy: drives the real `BlockManager` (no copy of its logic).

With sharing, a request's samples or beams are forks of one sequence (shared blocks, copy on
write of a shared last block) and shared system prompts hit the prefix cache. Without sharing,
every sample or beam allocates its own copy of the prompt and a beam that takes over another's
history copies all of its blocks.

Beam search is modelled stochastically: each step every beam survives with probability
`beam_keep`; the others are replaced by a child of a uniformly chosen survivor, so the beam
stays `beam_width` wide and its histories share a long common prefix, as real beams do.
"""

from __future__ import annotations

import random
import zlib

from engine.kv.block_manager import BlockManager
from pagedserve.sim.traces import Request
from pagedserve.sim.types import Group, MakeRoom, MemoryState

DECODE_TOKEN = 0


def prompt_token_ids(request: Request) -> list[int]:
    """Identical ids for a shared system prompt; ids unique to the request after it."""
    shared: list[int] = []
    if request.prefix_id is not None:
        base = zlib.crc32(request.prefix_id.encode()) * 100_000
        shared = [base + i for i in range(request.prefix_len)]
    own = range(request.prefix_len, request.prompt_len)
    return shared + [-(request.request_id * 1_000_000 + i + 1) for i in own]


class PagedPolicy:
    """PagedAttention block tables through `BlockManager`, with or without sharing."""

    kind = "paged"
    fragmentation_blocks = 0  # any free block serves any sequence

    def __init__(
        self, capacity: int, block_size: int, *, sharing: bool = True, beam_keep: float = 0.5, seed: int = 0
    ) -> None:
        self.block_size = block_size
        self.sharing = sharing
        self.name = f"paged-{block_size}" + ("" if sharing else "-noshare")
        self.block_manager = BlockManager(capacity // block_size, block_size, enable_prefix_caching=sharing)
        self.beam_keep = beam_keep
        self.rng = random.Random(seed)
        self.prefix_hit_tokens = 0
        self._next_seq_id = 0

    @property
    def cow_copies(self) -> int:
        return self.block_manager.cow_copies

    def try_admit(self, group: Group) -> bool:
        prompt = prompt_token_ids(group.request)
        fork = self.sharing and group.request.width > 1
        for i in range(group.request.width):
            seq_id = self._new_seq_id()
            if fork and i > 0:
                self.block_manager.fork(group.seq_ids[0], seq_id)
            elif self.block_manager.can_allocate(prompt):
                self.prefix_hit_tokens += self.block_manager.allocate(seq_id, prompt)
                self.block_manager.mark_computed(seq_id, len(prompt))
            else:
                return self._rollback(group)
            group.seq_ids.append(seq_id)
        for seq_id in group.seq_ids:  # tokens generated before a preemption, re-prefilled
            for _ in range(group.generated):
                if not self.block_manager.can_append_slot(seq_id):
                    return self._rollback(group)
                self.block_manager.append_slot(seq_id, DECODE_TOKEN)
        return True

    def step(self, group: Group, make_room: MakeRoom) -> bool:
        if group.request.beam_width > 1 and not self._reshuffle_beams(group, make_room):
            return False
        for seq_id in group.seq_ids:
            while not self.block_manager.can_append_slot(seq_id):
                if not make_room():
                    return False
            self.block_manager.append_slot(seq_id, DECODE_TOKEN)
        return True

    def release(self, group: Group) -> None:
        for seq_id in group.seq_ids:
            self.block_manager.free(seq_id)
        group.seq_ids.clear()

    def memory(self, head: Group | None) -> MemoryState:
        block_manager, size = self.block_manager, self.block_size
        logical = sum(len(block_manager.block_table(seq_id)) for seq_id in block_manager.seqs) * size
        free = block_manager.num_free_blocks * size
        return MemoryState(block_manager.num_stored_tokens, block_manager.num_used_blocks * size, 0, free, 0, logical)

    def _reshuffle_beams(self, group: Group, make_room: MakeRoom) -> bool:
        """Drop the beams that lose; each is replaced by a child of a surviving beam."""
        survivors = [s for s in group.seq_ids if self.rng.random() < self.beam_keep] or [group.seq_ids[0]]
        losers = [s for s in group.seq_ids if s not in survivors]
        for seq_id in losers:
            self.block_manager.free(seq_id)
        children: list[int] = []
        for _ in losers:
            parent, child = self.rng.choice(survivors), self._new_seq_id()
            if self.sharing:
                self.block_manager.fork(parent, child)
            else:
                tokens = [DECODE_TOKEN] * self.block_manager.num_tokens(parent)
                while not self.block_manager.can_allocate(tokens):
                    if not make_room():
                        group.seq_ids = survivors + children
                        return False
                self.block_manager.allocate(child, tokens)  # a private copy of the parent's whole history
            children.append(child)
        group.seq_ids = survivors + children
        return True

    def _rollback(self, group: Group) -> bool:
        self.release(group)
        return False

    def _new_seq_id(self) -> int:
        self._next_seq_id += 1
        return self._next_seq_id
