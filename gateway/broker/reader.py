"""One generation of the gateway's output-stream reader, and the readiness view over them.

A `Reader` is what one reader loop owns: a generation number and a connection (both fixed at
birth), whether it has started reading (its own `subscribed` event), the last output-stream id
it handled and when it last made progress. Only its own loop moves `last_id`, `read_at` and
`subscribed`; the broker's `_swap` is the only place that makes a new generation (which reads
on from its predecessor's last id) and retires the old one. So what a replaced loop still does
lands on a retired object nobody reads, and the broker's answers always come from the current
generation. Everything here runs on the event loop (no locks needed)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import redis.asyncio as aioredis


class Reader:
    """The state of one reader generation (see the module)."""

    __slots__ = ("_client", "_generation", "_last_id", "_read_at", "_retired", "subscribed")

    def __init__(self, generation: int, client: aioredis.Redis, last_id: str = "0-0") -> None:
        self._generation = generation
        self._client = client
        self._last_id = last_id
        self._read_at = time.monotonic()
        self.subscribed = asyncio.Event()  # set by this generation's loop once it reads (never by anyone else)
        self._retired = asyncio.Event()

    @property
    def generation(self) -> int:
        return self._generation

    @property
    def client(self) -> aioredis.Redis:
        return self._client

    @property
    def last_id(self) -> str:
        """The last output-stream id this generation handled (where the next read starts)."""
        return self._last_id

    @property
    def read_at(self) -> float:
        """When this generation's loop last made progress (monotonic)."""
        return self._read_at

    @property
    def retired(self) -> bool:
        return self._retired.is_set()

    def successor(self, client: aioredis.Redis) -> Reader:
        """The next generation, on `client`, reading on from this one's last id."""
        return Reader(self._generation + 1, client, self._last_id)

    def retire(self) -> None:
        """Replaced: its loop ends at its next turn (the broker's swap calls this)."""
        self._retired.set()

    # ----- written by this generation's own loop -----------------------------------------------
    def touch(self) -> None:
        self._read_at = time.monotonic()

    def handled(self, entry_id: str) -> None:
        """An entry was read (and dispatched): the next read starts after it."""
        self._last_id = entry_id

    def start_at(self, entry_id: str) -> None:
        """(Re)start reading after `entry_id` ("0-0": from the start)."""
        self._last_id = entry_id

    async def settled(self) -> None:
        """Until this generation is reading or was replaced."""
        waits = [asyncio.ensure_future(self.subscribed.wait()), asyncio.ensure_future(self._retired.wait())]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()


class Subscribed:
    """Read-only readiness: whether the current generation reads the output stream.
    `wait` follows swaps (a waiter never hangs on a retired generation)."""

    def __init__(self, current: Callable[[], Reader]) -> None:
        self._current = current

    def is_set(self) -> bool:
        return self._current().subscribed.is_set()

    async def wait(self) -> None:
        while not (reader := self._current()).subscribed.is_set():
            await reader.settled()
