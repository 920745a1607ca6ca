"""The broker's reader generations: swapped whole, a replaced loop's reads ignored."""

from __future__ import annotations

import asyncio
from typing import Any

from common.protocol import Keys
from gateway.broker.broker import Broker
from gateway.broker.reader import Reader


class _Client:
    """Stands in for a Redis client: only identity matters to the swap."""

    async def aclose(self) -> None:
        return None

    def register_script(self, script: str) -> object:
        return object()


def _broker() -> Broker:
    fresh: Any = _Client
    return Broker(_Client(), Keys("t"), "gw", reader=_Client(), new_reader=fresh)  # type: ignore[arg-type]


async def test_a_swap_makes_the_next_generation_whole_and_retires_the_old() -> None:
    broker = _broker()
    old = broker._reader
    old.handled("5-1")
    old.subscribed.set()
    new = broker._swap(fresh=True)
    assert old.retired and not new.retired
    assert (new.generation, new.last_id, new.subscribed.is_set()) == (old.generation + 1, "5-1", False)
    assert broker.reader is new.client is not old.client and broker.last_id == "5-1"
    old.handled("9-0")  # a stale loop moving its own position changes nothing the broker answers
    assert broker.last_id == "5-1"
    assert broker._swap(fresh=False).client is new.client


async def test_subscribed_follows_swaps() -> None:
    broker = _broker()
    waiter = asyncio.create_task(broker.subscribed.wait())
    await asyncio.sleep(0)
    old = broker._reader
    broker._swap(fresh=True)
    old.subscribed.set()  # the retired generation subscribing does not make the broker ready
    await asyncio.sleep(0)
    assert not waiter.done() and not broker.subscribed.is_set()
    broker._reader.subscribed.set()
    await asyncio.wait_for(waiter, 1)
    assert broker.subscribed.is_set()


async def test_a_replaced_loops_read_is_ignored(monkeypatch: Any) -> None:
    """The loop's read returns after a swap: it dispatches nothing and the new generation's
    position is untouched."""
    broker = _broker()
    dispatched: list[bytes] = []
    monkeypatch.setattr(broker, "_dispatch_guarded", dispatched.append)
    reading = asyncio.Event()
    release = asyncio.Event()

    async def start(reader: Reader, key: str) -> None:
        reader.subscribed.set()

    async def xread(*args: object, **kwargs: object) -> list[Any]:
        reading.set()
        await release.wait()
        return [(b"t:out:gw", [(b"7-0", {b"m": b"late"})])]

    monkeypatch.setattr(broker, "_start_reading", start)
    first = broker._swap(fresh=False)
    monkeypatch.setattr(first.client, "xread", xread, raising=False)
    loop = asyncio.create_task(broker.listen(reader=first))
    await asyncio.wait_for(reading.wait(), 1)
    broker._swap(fresh=True)
    release.set()
    await asyncio.wait_for(loop, 1)
    assert dispatched == [] and broker.last_id == "0-0" and first.last_id == "0-0"
