"""A least-recently-used map bounded by entry count and by an estimate of bytes held; safe to use
from several threads (the grammar compile workers put, the engine thread gets)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Generic, TypeVar

V = TypeVar("V")


class BoundedLRU(Generic[V]):
    """At most `max_entries` entries and `max_bytes` bytes (each entry's size is given by the
    caller when it is put); putting evicts the least recently used past either bound. An entry
    larger than `max_bytes` on its own is not kept. `get` marks an entry as recently used."""

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.bytes = 0  # the sizes of the entries held, summed
        self.evicted = 0
        self._items: OrderedDict[str, tuple[V, int]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str) -> V | None:
        with self._lock:
            item = self._items.get(key)
            if item is None:
                return None
            self._items.move_to_end(key)
            return item[0]

    def put(self, key: str, value: V, size: int) -> bool:
        """Keep `value` under `key`; False when it is too large to keep at all."""
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self.bytes -= old[1]
            if size > self.max_bytes:
                return False
            self._items[key] = (value, size)
            self.bytes += size
            while len(self._items) > self.max_entries or self.bytes > self.max_bytes:
                _, (_, dropped) = self._items.popitem(last=False)
                self.bytes -= dropped
                self.evicted += 1
            return True

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._items

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)
