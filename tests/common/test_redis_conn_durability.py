"""Durability across a failover, on real processes: a flush that returned is on a replica; a
WAIT whose connection was lost after the write raises NotReplicated (a reconnect would confirm
nothing); and sending the same outbox again (what the worker does then) shows its readers
nothing twice."""

from __future__ import annotations

import pytest
import redis

from common.protocol import Keys, OutputMessage, SeqOutput, decode_outputs, merge_progress
from common.redis_conn import NotReplicated, ReplicaAck, pinned, pooled_client
from common.redis_spec import RedisSpec
from engine.worker.outbox import Outbox, flush
from gateway.broker.collector import RequestCollector
from tests.fixtures.redis import MASTER_NAME, SentinelGroup

KEYS = Keys("dur")


def _outbox(seq: int, tokens: list[int], offset: int) -> Outbox:
    box = Outbox()
    box.add("gw", OutputMessage(id="r1", seq=seq, outputs=[SeqOutput(index=0, token_ids=tokens, offset=offset)]))
    return box


async def test_a_flushed_step_is_on_a_replica(sentinel_group: SentinelGroup) -> None:
    client = pooled_client(RedisSpec(sentinels=sentinel_group.sentinel_addresses, master=MASTER_NAME), 2, 5.0)
    ack = ReplicaAck.of(RedisSpec(sentinels=sentinel_group.sentinel_addresses))
    try:
        await flush(client, KEYS, KEYS.requests("m"), _outbox(0, [1, 2], 0), 60, [], None, ack)
        assert ack.acked and ack.figures.acked == 1
    finally:
        await client.aclose()
    master = sentinel_group.master_port()
    replicas = [port for port, proc in sentinel_group.nodes.items() if proc is not None and port != master]
    on_replicas = []
    for port in replicas:
        with redis.Redis(port=port) as replica:
            on_replicas.append(int(replica.xlen(KEYS.out("gw"))))
    assert max(on_replicas) == 1  # WAIT 1: at least one replica has it when flush returns


async def test_wait_after_a_lost_connection_raises(redis_server: str) -> None:
    client = pooled_client(redis_server, 2, 5.0)
    try:
        async with pinned(client) as conn:
            await conn.set("k", "v")
            connection = await conn.connection_pool.get_connection()
            await connection.disconnect()  # the master died after the write
            with pytest.raises(NotReplicated):
                await ReplicaAck(1, 100).wait(conn)
    finally:
        await client.aclose()


async def test_an_outbox_sent_twice_shows_nothing_twice(redis_server: str) -> None:
    """The worker sends an outbox again when its WAIT was cut off; both copies may survive."""
    client = pooled_client(redis_server, 2, 5.0)
    try:
        first, again = _outbox(0, [7, 8], 0), _outbox(0, [7, 8], 0)
        later = _outbox(1, [9], 2)
        for box in (first, again, later):
            await flush(client, KEYS, KEYS.requests("m"), box, 60, [])
        entries = await client.xrange(KEYS.out("gw"))
        progress = await client.lrange(KEYS.progress("gw", "r1"), 0, -1)
    finally:
        await client.aclose()
    collector = RequestCollector("r1", 1)
    for _entry_id, fields in entries:
        for message in decode_outputs(fields[b"m"]):
            collector.feed(message)
    update = await collector.next_update(1.0)
    assert update is not None and update.error is None and update.choices[0].token_ids == [7, 8, 9]
    assert merge_progress(progress).token_ids[0] == [7, 8, 9]
