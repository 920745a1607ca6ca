"""What the simulator loop and its memory policies share: a request's running state, a snapshot
of the KV memory, and the policy interface (contiguous or paged)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from pagedserve.sim.traces import Request

MakeRoom = Callable[[], bool]  # preempt the newest other running group; False when there is none


@dataclass(slots=True, eq=False)
class Group:
    """A request in flight: its sequences (one per sample or beam) all grow one token per step."""

    request: Request
    generated: int = 0
    seq_ids: list[int] = field(default_factory=list)
    preemptions: int = 0

    @property
    def length(self) -> int:
        """Tokens per sequence now (prompt + generated)."""
        return self.request.prompt_len + self.generated

    @property
    def done(self) -> bool:
        return self.generated >= self.request.output_len


@dataclass(frozen=True, slots=True)
class MemoryState:
    """KV memory in token slots. `tokens` hold a real token (a shared slot counts once);
    `reserved` are handed to sequences; `future` of those will hold a token later (reservation);
    `unusable_free` is free memory in pieces too small for the request at the head of the queue
    (external fragmentation); `logical` is what the sequences would hold with nothing shared."""

    tokens: int
    reserved: int
    future: int
    free: int
    unusable_free: int
    logical: int


class Policy(Protocol):
    """One way to hand KV memory to sequences."""

    name: str
    kind: str
    block_size: int
    sharing: bool
    prefix_hit_tokens: int
    fragmentation_blocks: int

    @property
    def cow_copies(self) -> int:
        """Copy-on-write block copies so far."""
        ...

    def try_admit(self, group: Group) -> bool:
        """Give a waiting group memory for its prompt (+ tokens generated before a preemption)."""
        ...

    def step(self, group: Group, make_room: MakeRoom) -> bool:
        """Room for one more token in each sequence; False when even preempting every newer
        group leaves too little (the caller then preempts this group)."""
        ...

    def release(self, group: Group) -> None:
        """Free everything the group holds."""
        ...

    def memory(self, head: Group | None) -> MemoryState:
        """The memory now; `head` is the next waiting group (None when the queue is empty)."""
        ...
