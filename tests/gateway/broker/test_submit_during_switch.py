"""A request submitted while `pagedserve switch-master` has the master's writes paused, on a real
Sentinel group (a master, two replicas, three sentinels): the paused submit gets READONLY from
the demoted node when the writes resume, and the gateway sends it to the new master, where it is
queued exactly once (before, the client got a 503 under a rolling restart of the whole fleet).
On a plain URL a replica stays a replica: the refusal is a 503 at once."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

from common.protocol import REQUEST_FIELD, EngineRequest, Keys
from common.redis_conn import ReplicaAck, pooled_client, refused_by_demoted_master
from common.redis_spec import RedisSpec
from common.sampling_params import SamplingParams
from gateway.broker.broker import Broker, BrokerUnavailable
from tests.fixtures.redis import MASTER_NAME, SentinelGroup

KEYS = Keys("t")
MODEL = "m"


def _broker(spec: RedisSpec) -> Broker:
    """A broker with the gateway's client options (gateway/app.py)."""
    client = pooled_client(spec, 8, 5.0, socket_connect_timeout=2.0, socket_timeout=10.0,
                           retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), retries=2))
    return Broker(client, KEYS, "gw", ack=ReplicaAck.of(spec), mode="sentinel" if spec.uses_sentinel else "url")


def _request(name: str) -> EngineRequest:
    return EngineRequest(id=name, gateway="gw", model=MODEL, prompt_token_ids=[1, 2, 3], params=SamplingParams(),
                         arrival=time.time())


def _paused_submits(master: redis.Redis) -> int:
    """Clients of `master` blocked in the submit script by CLIENT PAUSE."""
    return sum(1 for c in master.client_list() if c.get("cmd") == "evalsha" and "b" in c.get("flags", ""))


def _queued_ids(port: int) -> list[str]:
    with redis.Redis(port=port) as client:
        entries = client.xrange(KEYS.requests(MODEL))
    return [EngineRequest.decode(fields[REQUEST_FIELD.encode()]).id for _, fields in entries]


async def _until(condition: object, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(condition):  # type: ignore[arg-type]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def test_a_submit_paused_by_switch_master_is_queued_once_on_the_new_master(
        sentinel_group: SentinelGroup) -> None:
    broker = _broker(RedisSpec(sentinels=sentinel_group.sentinel_addresses, master=MASTER_NAME))
    try:
        await broker.submit(_request("before"), 1)
        old = sentinel_group.master_port()
        with redis.Redis(port=old) as master:
            master.execute_command("CLIENT", "PAUSE", 30_000, "WRITE")  # switch-master pauses again, then unpauses
            try:
                submit = asyncio.create_task(broker.submit(_request("during"), 1))
                await _until(lambda: _paused_submits(master) == 1, "the submit to wait on the paused master")
                done = await asyncio.to_thread(sentinel_group.switch_master)
            finally:
                master.execute_command("CLIENT", "UNPAUSE")
        assert done.returncode == 0, done.stderr[-3000:]
        collector = await asyncio.wait_for(submit, 60)
        new = sentinel_group.master_port()
        assert new != old
        assert _queued_ids(new) == ["before", "during"]
        assert collector.entry_id == (await broker.client.xrange(KEYS.requests(MODEL)))[-1][0].decode()
    finally:
        await broker.client.aclose()


async def test_a_replica_by_url_is_refused_at_once(sentinel_group: SentinelGroup) -> None:
    master = sentinel_group.master_port()
    replica = next(port for port, proc in sentinel_group.nodes.items() if port != master and proc is not None)
    on_master = _broker(RedisSpec(sentinels=sentinel_group.sentinel_addresses, master=MASTER_NAME))
    try:
        await on_master.sync_epoch(MODEL)  # the model's epoch key, replicated: the replica's reads find it
    finally:
        await on_master.client.aclose()
    with redis.Redis(port=replica) as client:
        await _until(lambda: client.get(KEYS.epoch(MODEL)) is not None, "the epoch key on the replica")
    broker = _broker(RedisSpec(url=f"redis://127.0.0.1:{replica}/0"))
    sent = 0
    submit_once = broker._submit_once

    async def counted(request: EngineRequest, stream: str) -> tuple[str, str]:
        nonlocal sent
        sent += 1
        return await submit_once(request, stream)

    broker._submit_once = counted  # type: ignore[method-assign]
    try:
        with pytest.raises(BrokerUnavailable) as caught:
            await broker.submit(_request("r"), 1)
        assert refused_by_demoted_master(caught.value.__cause__)  # type: ignore[arg-type]
        assert sent == 1 and broker.collectors == {}  # not sent again
    finally:
        await broker.client.aclose()
