"""The pre-PagedAttention baselines: every sequence's KV cache is one contiguous range of a
single linear address space, handed out by a first-fit allocator.

- `max`: reserve `max_model_len` slots per sequence (the length is unknown in advance), so
  reservation (slots for tokens still to come) and internal fragmentation (slots never used)
  both appear, and external fragmentation whenever reservations differ in size.
- `oracle`: reserve exactly prompt + output (an oracle knows the final length): no internal
  fragmentation, but reservation and external fragmentation remain.
"""

from __future__ import annotations

from bisect import bisect_left

from pagedserve.sim.types import Group, MakeRoom, MemoryState


class FirstFitAllocator:
    """First fit over [0, capacity): holes sorted by address, coalesced on free."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self._starts: list[int] = [0]
        self._sizes: list[int] = [capacity]
        self._used: dict[int, int] = {}

    @property
    def num_free(self) -> int:
        return sum(self._sizes)

    def free_below(self, size: int) -> int:
        """Free slots in holes smaller than `size`: unusable for a range of that size."""
        return sum(hole for hole in self._sizes if hole < size)

    @property
    def holes(self) -> list[tuple[int, int]]:
        """(start, size) of every free range, by address."""
        return list(zip(self._starts, self._sizes, strict=True))

    def allocate(self, size: int) -> int | None:
        """Start address of the lowest hole that fits `size`, or None."""
        if size < 1:
            raise ValueError("size must be >= 1")
        for i, hole in enumerate(self._sizes):
            if hole >= size:
                start = self._starts[i]
                if hole == size:
                    del self._starts[i], self._sizes[i]
                else:
                    self._starts[i] += size
                    self._sizes[i] -= size
                self._used[start] = size
                return start
        return None

    def free(self, start: int) -> None:
        """Return a range, merging it with free neighbours."""
        size = self._used.pop(start)
        i = bisect_left(self._starts, start)
        if i < len(self._starts) and start + size == self._starts[i]:  # merge with the next hole
            size += self._sizes[i]
            del self._starts[i], self._sizes[i]
        if i > 0 and self._starts[i - 1] + self._sizes[i - 1] == start:  # merge with the previous
            self._sizes[i - 1] += size
        else:
            self._starts.insert(i, start)
            self._sizes.insert(i, size)


class ContiguousPolicy:
    """Contiguous KV ranges per sequence: `max_model_len` each, or the exact final length."""

    block_size = 1
    sharing = False
    cow_copies = 0
    prefix_hit_tokens = 0

    def __init__(self, capacity: int, max_model_len: int, *, oracle: bool = False) -> None:
        self.kind = "contiguous-oracle" if oracle else "contiguous-max"
        self.name = self.kind
        self.oracle = oracle
        self.max_model_len = max_model_len
        self.allocator = FirstFitAllocator(capacity)
        self.groups: dict[int, tuple[Group, list[int]]] = {}
        self.fragmentation_blocks = 0  # admissions refused although enough memory was free

    def reservation(self, group: Group) -> int:
        """Slots one sequence of the group reserves."""
        return group.request.total_len if self.oracle else self.max_model_len

    def try_admit(self, group: Group) -> bool:
        size = self.reservation(group)
        starts: list[int] = []
        for _ in range(group.request.width):
            start = self.allocator.allocate(size)
            if start is None:
                if self.allocator.num_free >= size * (group.request.width - len(starts)):
                    self.fragmentation_blocks += 1
                for taken in starts:
                    self.allocator.free(taken)
                return False
            starts.append(start)
        self.groups[group.request.request_id] = (group, starts)
        return True

    def step(self, group: Group, make_room: MakeRoom) -> bool:
        return True  # the reservation already holds every token the sequence will produce

    def release(self, group: Group) -> None:
        _, starts = self.groups.pop(group.request.request_id)
        for start in starts:
            self.allocator.free(start)

    def memory(self, head: Group | None) -> MemoryState:
        tokens = reserved = future = 0
        for group, starts in self.groups.values():
            size, width = self.reservation(group), len(starts)
            tokens += width * group.length
            reserved += width * size
            future += width * (min(group.request.total_len, size) - group.length)
        unusable = self.allocator.free_below(self.reservation(head)) if head is not None else 0
        return MemoryState(tokens, reserved, future, self.allocator.num_free, unusable, reserved)
