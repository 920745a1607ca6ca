"""The engine's side of gateway liveness (issue 41) on a real redis-server, without a model: requests
read from the stream, the flush's probe of each gateway's liveness token, and the guards'
verdict. A gateway gone within the grace keeps its requests; past it, or with another token
(a restarted process), each request ends with an error record on that gateway's output stream,
its entry acknowledged and deleted, and its id handed to the engine to drop (blocks freed)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from common.protocol import REQUEST_FIELD, EngineRequest, Keys, decode_outputs
from common.sampling_params import SamplingParams
from engine.worker.guards import GATEWAY_GRACE_S, Guards
from engine.worker.intake import Intake
from engine.worker.outbox import flush
from engine.worker.request_stream import RequestStream

KEYS = Keys("live")
MODEL = "m"


@pytest.fixture
async def intake(redis_server: str) -> AsyncIterator[Intake]:
    client = aioredis.Redis.from_url(redis_server)
    await client.flushdb()
    stream = RequestStream(client, KEYS, MODEL, "eng-1")
    await stream.ensure_group()
    yield Intake(client, KEYS, stream, MODEL)
    await client.aclose()


async def _submit(intake: Intake, request_id: str, gateway: str, token: str) -> None:
    request = EngineRequest(id=request_id, gateway=gateway, model=MODEL, prompt_token_ids=[1, 2, 3],
                            params=SamplingParams(max_tokens=8), arrival=0.0,
                            gateway_token=token)
    await intake.client.xadd(KEYS.requests(MODEL), {REQUEST_FIELD: request.encode()})


async def _probe(intake: Intake, guards: Guards, now: float) -> list[str]:
    reply = await flush(intake.client, KEYS, intake.stream.key, intake.take_pending(), 60,
                        guards.gateways_to_probe())
    return guards.on_probe(reply.alive, now=now)


async def _errors(intake: Intake, gateway: str) -> dict[str, str | None]:
    await flush(intake.client, KEYS, intake.stream.key, intake.take_pending(), 60, [])
    found: dict[str, str | None] = {}
    for _id, fields in await intake.client.xrange(KEYS.out(gateway)):
        for out in decode_outputs(fields[REQUEST_FIELD.encode()]):
            found[out.id] = out.error.code if out.error is not None else None
    return found


def test_the_default_grace_tolerates_a_long_pause() -> None:
    assert GATEWAY_GRACE_S >= 30


async def test_a_gone_gateway_keeps_its_requests_for_the_grace_then_each_gets_an_error(intake: Intake) -> None:
    await intake.client.set(KEYS.gateway("gw-a"), "tok-a", px=60_000)
    for i in range(3):
        await _submit(intake, f"a{i}", "gw-a", "tok-a")
    assert await intake.pull(10, None) == 3
    guards = Guards(intake, gateway_grace_s=30.0)
    assert await _probe(intake, guards, now=100.0) == []
    await intake.client.delete(KEYS.gateway("gw-a"))  # its TTL ran out: paused, or cut off from Redis
    assert await _probe(intake, guards, now=101.0) == []
    assert await _probe(intake, guards, now=130.9) == []  # 29.9 s gone: still within the grace
    assert intake.gateways_missing == 1 and len(intake.tracked) == 3
    assert sorted(await _probe(intake, guards, now=131.0)) == ["a0", "a1", "a2"]
    assert not intake.tracked and intake.forced_aborts == {"a0", "a1", "a2"}  # the engine frees their blocks
    assert await _errors(intake, "gw-a") == {"a0": "gateway_gone", "a1": "gateway_gone", "a2": "gateway_gone"}
    assert await intake.client.xlen(KEYS.requests(MODEL)) == 0  # acknowledged and deleted
    assert intake.counters()["gateway_gone_aborted"] == 3


async def test_a_gateway_back_within_the_grace_starts_a_fresh_clock_next_time(intake: Intake) -> None:
    await _submit(intake, "b0", "gw-b", "tok-b")
    await intake.pull(10, None)
    guards = Guards(intake, gateway_grace_s=30.0)
    assert await _probe(intake, guards, now=0.0) == []  # gone
    await intake.client.set(KEYS.gateway("gw-b"), "tok-b", px=60_000)
    assert await _probe(intake, guards, now=20.0) == []  # back
    await intake.client.delete(KEYS.gateway("gw-b"))
    assert await _probe(intake, guards, now=40.0) == []  # gone again: 0 s of this pause, not 40
    assert list(intake.tracked) == ["b0"]


async def test_a_restarted_gateway_stops_the_old_process_requests_at_once(intake: Intake) -> None:
    await intake.client.set(KEYS.gateway("gw-c"), "old", px=60_000)
    await _submit(intake, "c-old", "gw-c", "old")
    await _submit(intake, "c-legacy", "gw-c", "")  # from a gateway without tokens: presence alone counts
    await intake.pull(10, None)
    guards = Guards(intake, gateway_grace_s=30.0)
    assert await _probe(intake, guards, now=0.0) == []
    await intake.client.set(KEYS.gateway("gw-c"), "new", px=60_000)  # killed, restarted under the same id
    await _submit(intake, "c-new", "gw-c", "new")
    await intake.pull(10, None)
    assert await _probe(intake, guards, now=0.1) == ["c-old"]
    assert sorted(intake.tracked) == ["c-legacy", "c-new"]
    assert await _errors(intake, "gw-c") == {"c-old": "gateway_restarted"}
    assert intake.counters()["gateway_restart_aborted"] == 1
