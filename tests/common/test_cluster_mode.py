"""The engine's and the gateway's Redis writes on a real Redis Cluster (one node holding every
slot: the cluster's rules, CROSSSLOT for a script or transaction over several slots among them,
are enforced as on many nodes): heartbeat, submit script (with and without WAIT on a connection
pinned to the slot's master), reading the shared and routed streams in one XREADGROUP, the
fenced flush split per slot, the takeover of a dead engine's entries, its removal."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from common.engine_set import read_heartbeats
from common.protocol import EngineRequest, Keys, OutputMessage, SeqOutput, decode_outputs
from common.redis_conn import MasterView, ReplicaAck, pooled_client
from common.redis_slots import is_cluster, pinned_to, slot_moved
from common.redis_spec import RedisSpec
from common.sampling_params import SamplingParams
from engine.worker.heartbeat import Heartbeat
from engine.worker.outbox import Fence, FenceLost, Outbox, flush
from engine.worker.request_stream import RequestStream
from gateway.broker.broker import Broker
from tests.fixtures.redis_cluster import RedisClusterGroup

KEYS = Keys()
MODEL = "tiny"


@pytest.fixture
async def client(redis_cluster_node: RedisClusterGroup) -> AsyncIterator[aioredis.Redis]:
    spec = RedisSpec(cluster=redis_cluster_node.addresses)
    assert spec.mode == "cluster" and spec.replicas_to_wait == 1
    client = pooled_client(spec, 8, 5.0, socket_timeout=5.0)
    assert is_cluster(client)
    yield client
    await client.aclose(close_connection_pool=True)


def _request(request_id: str) -> EngineRequest:
    return EngineRequest(id=request_id, gateway="gw", model=MODEL, prompt_token_ids=[1, 2, 3],
                         params=SamplingParams(), arrival=time.time())


def _message(request_id: str, seq: int, tokens: list[int]) -> OutputMessage:
    return OutputMessage(id=request_id, seq=seq, outputs=[SeqOutput(index=0, token_ids=tokens, offset=seq)])


@pytest.mark.parametrize("replicas", [0, 1])
async def test_a_request_goes_through_a_cluster(client: aioredis.Redis, replicas: int) -> None:
    ack = ReplicaAck(replicas, 50, retry_s=0)  # no replica here: a WAIT times out and the write counts unacknowledged
    beat = Heartbeat(client, KEYS, "e1", MODEL, "/tok", 64, ttl_s=30)
    await beat.beat({}, [], {})
    assert await client.exists(KEYS.alive(MODEL, "e1"), KEYS.engine("e1")) == 2
    assert [raw[b"engine_id"] for raw in await read_heartbeats(client, KEYS, 60)] == [b"e1"]

    broker = Broker(client, KEYS, "gw", ack=ack, mode="cluster")
    shared = RequestStream(client, KEYS, MODEL, "e1")
    routed = RequestStream(client, KEYS, MODEL, "e1", key=KEYS.routed(MODEL, "e1"),
                           register=KEYS.routed_streams(MODEL))
    await shared.ensure_group()
    await routed.ensure_group()
    collector = await broker.submit(_request("r1"), 1)
    entries = await shared.read_new_with(routed, 10, None)
    assert [(e.entry_id, e.stream) for e in entries] == [(collector.entry_id, KEYS.requests(MODEL))]

    outbox = Outbox()
    outbox.add("gw", _message("r1", 0, [7]))
    fence = Fence(beat.alive_key, lambda: True)
    reply = await flush(client, KEYS, shared.key, outbox, 60, ["gw"], fence, ack, None, KEYS.epoch(MODEL))
    assert reply.epoch == broker.epoch_of(MODEL).token and reply.alive == {"gw": None}
    assert await client.llen(KEYS.progress("gw", "r1")) == 1  # the checkpoint, in the gateway's slot

    outbox = Outbox()
    outbox.add("gw", _message("r1", 1, [8]))
    outbox.end("r1", entries[0].entry_id, gateway="gw")
    await flush(client, KEYS, shared.key, outbox, 60, [], fence, ack, None, KEYS.epoch(MODEL))
    assert not await client.exists(KEYS.progress("gw", "r1"))
    assert await client.xlen(shared.key) == 0  # acked and deleted
    sent = [m for _, fields in await client.xrange(KEYS.out("gw")) for m in decode_outputs(fields[b"m"])]
    assert [(m.id, m.seq) for m in sent] == [("r1", 0), ("r1", 1)]
    if replicas:
        # the submit, the first flush's output (its model transaction wrote nothing), the second
        # flush's output and acks: one WAIT on the master of each slot written
        assert ack.figures.waits == 4 and ack.acked is False

    await client.delete(beat.alive_key)
    with pytest.raises(FenceLost):  # the liveness key is gone: nothing is written
        await flush(client, KEYS, shared.key, Outbox(), 60, [], fence, ack, None, KEYS.epoch(MODEL))

    view = MasterView()
    await view.refresh(client)
    assert view.address.endswith(str(client.get_default_node().port)) and view.run_id


async def test_takeover_of_a_dead_engine_on_a_cluster(client: aioredis.Redis) -> None:
    dead = RequestStream(client, KEYS, MODEL, "dead")
    await dead.ensure_group()
    broker = Broker(client, KEYS, "gw", mode="cluster")
    await broker.submit(_request("r2"), 1)
    assert len(await dead.read_new(10, None)) == 1
    alive = Heartbeat(client, KEYS, "e2", MODEL, "/tok", 64, ttl_s=30)
    await alive.beat({}, [], {})
    mine = RequestStream(client, KEYS, MODEL, "e2")
    await client.set(KEYS.alive(MODEL, "dead"), 1)
    assert await mine.claim_from("dead", 0) == []  # its liveness key holds: nothing moves
    await client.delete(KEYS.alive(MODEL, "dead"))
    assert await mine.dead_consumers() == ["dead"]
    claimed = await mine.claim_from("dead", 0)
    assert [EngineRequest.decode(e.payload).id for e in claimed if e.payload] == ["r2"]
    await alive.remove()
    assert not await client.exists(KEYS.alive(MODEL, "e2"), KEYS.engine("e2"))
    assert await read_heartbeats(client, KEYS, None) == []


async def test_a_write_to_a_master_that_does_not_serve_the_slot_is_seen_as_moved() -> None:
    group = RedisClusterGroup(masters=3, replicas=0)
    try:
        key = KEYS.requests(MODEL)
        wrong = next(port for port in group.masters() if port != group.master_of(key))
        async with aioredis.Redis(port=wrong) as node:
            with pytest.raises(RedisError) as plain:
                await node.xadd(key, {"m": b"x"})
            with pytest.raises(RedisError) as in_multi:
                async with node.pipeline(transaction=True) as pipe:
                    pipe.xadd(key, {"m": b"x"})
                    pipe.get(KEYS.epoch(MODEL))
                    await pipe.execute()
        assert slot_moved(plain.value) and slot_moved(in_multi.value)  # nothing written: send it again
        client = pooled_client(RedisSpec(cluster=group.addresses), 4, 5.0)
        try:
            async with pinned_to(client, key) as conn:  # the slot's own master: the write lands
                assert await conn.xadd(key, {"m": b"x"})
            assert await client.xlen(key) == 1
        finally:
            await client.aclose()
    finally:
        group.stop()
