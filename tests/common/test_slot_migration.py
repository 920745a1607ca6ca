"""The engine's and the gateway's Redis writes and reads while a slot migrates between two
masters of a real Redis Cluster (3 masters, 3 replicas), held at each step of
`redis-cli --cluster reshard`: MIGRATING/IMPORTING with the keys on the source, every key on
the target but the slot not handed over (the source answers ASK), keys split between the two
(TRYAGAIN for a command over several of them), handed over (MOVED).

A request goes through at each step of moving its model's slot: heartbeat, the submit script
with its WAIT, the engine's XREADGROUP, fenced flushes with checkpoints and the ack. A request
streams on through every step of moving its gateway's slot (its output stream and checkpoint).
Plain commands follow ASK however many idle connections the client holds to the target; a
transaction over keys split between the two nodes writes nothing until they are together again."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import pytest
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from common.protocol import EngineRequest, Keys, OutputMessage, SeqOutput, decode_outputs
from common.redis_conn import ReplicaAck, pooled_client
from common.redis_slots import slot_moved, slot_pipeline
from common.redis_spec import RedisSpec
from common.sampling_params import SamplingParams
from engine.worker.heartbeat import Heartbeat
from engine.worker.outbox import Fence, Outbox, flush
from engine.worker.request_stream import RequestStream
from gateway.broker.broker import Broker
from tests.fixtures.redis_cluster import RedisClusterGroup
from tests.fixtures.redis_reshard import SlotMigration, slot_master

KEYS = Keys()
IDLE = 4  # idle connections the client keeps to the target before a redirect


@pytest.fixture(scope="module")
def group() -> Iterator[RedisClusterGroup]:
    group = RedisClusterGroup(masters=3, replicas=1)
    try:
        yield group
    finally:
        group.stop()


@pytest.fixture
async def client(group: RedisClusterGroup) -> AsyncIterator[aioredis.Redis]:
    client = pooled_client(RedisSpec(cluster=group.addresses), 16, 5.0, socket_timeout=5.0)
    yield client
    await client.aclose(close_connection_pool=True)


async def _idle_connections(client: aioredis.Redis, port: int) -> None:
    """Leave `IDLE` connected, idle connections to the master on `port` in the client's pool."""
    node = next(n for n in client.get_primaries() if n.port == port)  # type: ignore[attr-defined]
    connections = [node.acquire_connection() for _ in range(IDLE)]
    for connection in connections:
        await connection.connect()
    for connection in connections:
        node.release(connection)


def _request(request_id: str, model: str) -> EngineRequest:
    return EngineRequest(id=request_id, gateway="gw", model=model, prompt_token_ids=[1, 2, 3],
                         params=SamplingParams(), arrival=time.time())


class Flow:
    """One engine and one gateway going through the product's own calls: submit (script and
    WAIT), XREADGROUP, fenced flushes of output with checkpoints, the end with its ack."""

    def __init__(self, client: aioredis.Redis, model: str, gateway: str) -> None:
        self.client, self.model, self.gateway = client, model, gateway
        self.ack = ReplicaAck(1, 2000)
        self.beat = Heartbeat(client, KEYS, "e1", model, "/tok", 64, ttl_s=30)
        self.broker = Broker(client, KEYS, gateway, ack=self.ack, mode="cluster")
        self.stream = RequestStream(client, KEYS, model, "e1")
        self.entries: dict[str, str] = {}

    async def submit(self, request_id: str) -> None:
        """Heartbeat, submit, and the engine's read of the request."""
        await self.beat.beat({}, [], {})
        await self.stream.ensure_group()
        collector = await self.broker.submit(_request(request_id, self.model), 1)
        entries = await self.stream.read_new(10, 100)
        assert [e.entry_id for e in entries] == [collector.entry_id]
        self.entries[request_id] = collector.entry_id

    async def emit(self, request_id: str, seq: int, end: bool = False) -> None:
        """One token of output (and with `end`, the request's end and ack), flushed fenced."""
        outbox = Outbox()
        outbox.add(self.gateway, OutputMessage(id=request_id, seq=seq,
                                               outputs=[SeqOutput(index=0, token_ids=[seq], offset=seq)]))
        if end:
            outbox.end(request_id, self.entries[request_id], gateway=self.gateway)
        fence = Fence(self.beat.alive_key, lambda: True)
        reply = await flush(self.client, KEYS, self.stream.key, outbox, 60, [], fence, self.ack, None,
                            KEYS.epoch(self.model))
        assert reply.epoch == self.broker.epoch_of(self.model).token
        assert bool(await self.client.exists(KEYS.progress(self.gateway, request_id))) is not end
        assert self.ack.acked
        if end:
            del self.entries[request_id]

    async def sent(self, request_id: str) -> list[int]:
        """The tokens the gateway's output stream holds for the request, in order."""
        raw = await self.client.xrange(KEYS.out(self.gateway))
        return [m.outputs[0].token_ids[0] for _, fields in raw for m in decode_outputs(fields[b"m"])
                if m.id == request_id]

    async def serve(self, request_id: str) -> None:
        """A whole request: submitted, two tokens, ended; its stream entry acked and deleted."""
        await self.submit(request_id)
        await self.emit(request_id, 0)
        await self.emit(request_id, 1, end=True)
        assert await self.sent(request_id) == [0, 1]
        assert await self.client.xlen(self.stream.key) == 0


async def _after_hand_over(step: Callable[[], Awaitable[None]]) -> None:
    """`step`, sent again once when the first pinned write after the hand-over met MOVED (it
    refreshed the slot map)."""
    try:
        await step()
    except RedisError as exc:
        assert slot_moved(exc), exc
        await step()


async def test_requests_go_through_every_step_of_moving_a_models_slot(
        group: RedisClusterGroup, client: aioredis.Redis) -> None:
    flow = Flow(client, "m-moved", "gw-still")
    await flow.serve("before")
    migration = SlotMigration.of_key(group, KEYS.requests(flow.model)).start()
    await _idle_connections(client, migration.target)
    await flow.serve("migrating")
    migration.move()
    assert migration.keys_left() == [] and migration.keys_moved()
    await _idle_connections(client, migration.target)
    await flow.serve("asked")  # every key on the target: the source answers ASK
    migration.finish()
    assert slot_master(group, migration.slot) == migration.target
    await _after_hand_over(lambda: flow.serve("after"))


async def test_a_request_streams_on_through_every_step_of_moving_its_gateways_slot(
        group: RedisClusterGroup, client: aioredis.Redis) -> None:
    flow = Flow(client, "m-still", "gw-moved")
    await flow.submit("long")
    await flow.emit("long", 0)
    migration = SlotMigration.of_key(group, KEYS.out(flow.gateway)).start()
    await _idle_connections(client, migration.target)
    await flow.emit("long", 1)
    migration.move()
    assert migration.keys_left() == [] and migration.keys_moved()
    await _idle_connections(client, migration.target)
    await flow.emit("long", 2)  # output stream and checkpoint on the target: ASK
    assert await flow.sent("long") == [0, 1, 2]
    migration.finish()
    await _after_hand_over(lambda: flow.emit("long", 3, end=True))
    assert await flow.sent("long") == [0, 1, 2, 3]


async def test_plain_reads_follow_ask_whatever_idle_connections_the_client_holds(
        group: RedisClusterGroup, client: aioredis.Redis) -> None:
    stream, missing = KEYS.requests("m-plain"), KEYS.epoch("m-plain")
    await client.xadd(stream, {"m": b"x"})
    migration = SlotMigration.of_key(group, stream).start()
    migration.move()
    for _ in range(3):
        await _idle_connections(client, migration.target)
        assert await client.get(missing) is None
        assert [len(entries) for _, entries in await client.xread({stream: "0-0"})] == [1]
    migration.finish()


async def test_a_transaction_over_keys_split_between_two_nodes_writes_nothing_until_they_meet(
        group: RedisClusterGroup, client: aioredis.Redis) -> None:
    first, second = KEYS.requests("m-split"), KEYS.epoch("m-split")
    await client.xadd(first, {"m": b"x"})
    await client.set(second, "e")
    migration = SlotMigration.of_key(group, first).start()
    assert migration.move(1) == 1  # one on each node: TRYAGAIN, however often it is sent again
    with pytest.raises(RedisError) as refused:
        async with slot_pipeline(client, first) as pipe:
            pipe.xadd(first, {"m": b"y"})
            pipe.set(second, "f")
            await pipe.execute()
    assert slot_moved(refused.value), refused.value
    migration.move()
    async with slot_pipeline(client, first) as pipe:  # together on the target: ASK, then written there
        pipe.xadd(first, {"m": b"y"})
        pipe.set(second, "f")
        await pipe.execute()
    migration.finish()
    assert await client.xlen(first) == 2 and await client.get(second) == b"f"
