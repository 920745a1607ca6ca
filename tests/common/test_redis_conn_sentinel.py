"""The connection factory with Redis Sentinel, against real processes: `--redis-sentinel`
parsing, clients that follow a failover (the old master's connections dropped, or answering
READONLY once demoted), WAIT on the connection that wrote, and a failover that is not taken
for a data loss (the epoch survives, the run id changes)."""

from __future__ import annotations

import argparse
import asyncio

import pytest
import redis
import redis.asyncio as aioredis

from common.redis_conn import Epoch, MasterView, MeteredPool, ReplicaAck, pinned, pooled_client, single_client
from common.redis_spec import RedisSpec, add_redis_arguments, parse_sentinels, spec_from_args
from tests.fixtures.redis import MASTER_NAME, SentinelGroup


@pytest.mark.parametrize(("text", "expected"), [
    ("10.0.0.1:26380", (("10.0.0.1", 26380),)),
    ("a:1, b:2 ,c", (("a", 1), ("b", 2), ("c", 26379))),
    ("[::1]:5000,[fe80::1]", (("::1", 5000), ("fe80::1", 26379))),
])
def test_parse_sentinels(text: str, expected: tuple[tuple[str, int], ...]) -> None:
    assert parse_sentinels(text) == expected


@pytest.mark.parametrize("text", ["", " , ", "a:x", "a:0", "a:70000", ":1", "::1:5", "[::1", "a:1,a:1"])
def test_parse_sentinels_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_sentinels(text)


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_redis_arguments(parser)
    return parser.parse_args(list(argv))


def test_spec_from_args(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PAGEDSERVE_REDIS_SENTINEL", raising=False)
    monkeypatch.setenv("PAGEDSERVE_REDIS_PASSWORD", "s3cret")
    plain = spec_from_args(_args("--redis-url", "redis://h:1/2"))
    assert not plain.uses_sentinel and plain.url == "redis://h:1/2" and plain.replicas_to_wait == 0
    spec = spec_from_args(_args("--redis-sentinel", "s1:1,s2:2", "--redis-sentinel-master", "prod", "--redis-tls"))
    assert spec.sentinels == (("s1", 1), ("s2", 2)) and spec.master == "prod" and spec.tls
    assert spec.password == "s3cret" and spec.replicas_to_wait == 1
    assert "s3cret" not in spec.describe() and "prod" in spec.describe()
    assert spec_from_args(_args("--redis-sentinel", "s1", "--redis-wait-replicas", "0")).replicas_to_wait == 0
    with pytest.raises(ValueError):
        spec_from_args(_args("--redis-sentinel", "s1:nope"))
    with pytest.raises(ValueError):
        RedisSpec(sentinels=(("s", 1),), wait_timeout_ms=0)


def _spec(group: SentinelGroup) -> RedisSpec:
    return RedisSpec(sentinels=group.sentinel_addresses, master=MASTER_NAME)


def _retrying() -> dict[str, object]:
    from redis.asyncio.retry import Retry
    from redis.backoff import ExponentialBackoff

    return {"retry": Retry(ExponentialBackoff(cap=0.5, base=0.05), retries=3), "socket_timeout": 5.0}


async def _eventually(write: object, timeout: float = 30.0) -> float:
    """Retry `write()` (an awaitable factory) until it succeeds; the seconds it took."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    while True:
        try:
            await write()  # type: ignore[operator]
            return loop.time() - start
        except (redis.RedisError, OSError):
            if loop.time() - start > timeout:
                raise
            await asyncio.sleep(0.2)


async def test_pooled_client_follows_a_failover(sentinel_group: SentinelGroup) -> None:
    client = pooled_client(_spec(sentinel_group), 4, 5.0, **_retrying())
    try:
        assert isinstance(client.connection_pool, MeteredPool)
        await client.set("k", "before")
        old = sentinel_group.master_port()
        view = MasterView()
        await view.refresh(client)
        assert view.address == f"127.0.0.1:{old}" and view.replicas == 2
        sentinel_group.kill_master()
        new = sentinel_group.wait_failover(old)
        await _eventually(lambda: client.set("k2", "after"))
        assert await client.get("k") == b"before"  # the replica had it: nothing lost
        assert await view.refresh(client) and view.address == f"127.0.0.1:{new}"
    finally:
        await client.aclose()


async def test_readonly_from_a_demoted_master_reconnects(sentinel_group: SentinelGroup) -> None:
    """A connection to the old master once it is a replica gets READONLY: it is dropped as a
    connection error, its next connect asks the sentinels, and writes land on the new master."""
    old = sentinel_group.master_port()
    client = pooled_client(_spec(sentinel_group), 2, 5.0, **_retrying())
    try:
        await client.set("k", "v")
        with redis.Redis(port=next(iter(sentinel_group.sentinel_procs))) as sentinel:
            sentinel.sentinel_failover(MASTER_NAME)  # graceful: the old master lives on, demoted
        new = sentinel_group.wait_failover(old)
        with redis.Redis(port=old) as demoted:
            _wait_role(demoted, "slave")
        connection = await client.connection_pool.get_connection()
        try:
            await connection.disconnect()
            await connection.connect_to(("127.0.0.1", old))  # type: ignore[attr-defined]
            await connection.send_command("SET", "k", "on-old")
            with pytest.raises(redis.ConnectionError, match="now a slave"):
                await connection.read_response()
            assert not connection.is_connected
            await connection.connect()  # asks the sentinels
            assert connection.port == new  # type: ignore[attr-defined]
        finally:
            await client.connection_pool.release(connection)
        await _eventually(lambda: client.set("k", "on-new"))
        with redis.Redis(port=new) as direct:
            assert direct.get("k") == b"on-new"
    finally:
        await client.aclose()


async def test_writes_paused_by_a_switch_are_retried_on_the_new_master(sentinel_group: SentinelGroup) -> None:
    """Writes waiting on `switch-master`'s CLIENT PAUSE get READONLY from the demoted node when
    it unpauses; the client's own retry (one, as the gateway's client has two) reconnects to the
    master the sentinels report, not to the address the connection had, and each write lands
    once: none fails (redis-py's send path reconnected to the old address: all five failed)."""
    client = pooled_client(_spec(sentinel_group), 8, 5.0, **_retrying())
    try:
        await client.set("n", 0)
        old = sentinel_group.master_port()
        with redis.Redis(port=old) as master:
            master.execute_command("CLIENT", "PAUSE", 30_000, "WRITE")
            try:
                writes = [asyncio.create_task(client.incr("n")) for _ in range(5)]
                deadline = asyncio.get_running_loop().time() + 30
                while sum(c.get("cmd") == "incrby" and "b" in c.get("flags", "") for c in master.client_list()) < 5:
                    assert asyncio.get_running_loop().time() < deadline, master.client_list()
                    await asyncio.sleep(0.05)
                done = await asyncio.to_thread(sentinel_group.switch_master)
            finally:
                master.execute_command("CLIENT", "UNPAUSE")
        assert done.returncode == 0, done.stderr[-3000:]
        assert sorted(await asyncio.gather(*writes)) == [1, 2, 3, 4, 5]
        with redis.Redis(port=sentinel_group.master_port()) as new:
            assert new.get("n") == b"5"
    finally:
        await client.aclose()


def _wait_role(client: redis.Redis, role: str, timeout: float = 20.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while client.info("replication")["role"] != role:
        assert time.monotonic() < deadline, f"never became {role}"
        time.sleep(0.1)


async def test_failover_is_not_a_data_loss(sentinel_group: SentinelGroup) -> None:
    client = single_client(_spec(sentinel_group), **_retrying())
    try:
        epoch = Epoch("ps:epoch")
        assert not await epoch.check(client)
        token = epoch.token
        view = MasterView()
        await view.refresh(client)
        ack = ReplicaAck(1, 2000)
        async with pinned(client) as conn:  # the epoch key is on a replica before the kill
            await conn.set("ps:marker", "1")
            assert await ack.wait(conn)
        old = sentinel_group.kill_master()
        sentinel_group.wait_failover(old)
        await _eventually(lambda: epoch.check(client))
        assert epoch.token == token  # same dataset: nothing to fail
        assert await view.refresh(client)  # but a new master (run id)
        assert await client.get("ps:marker") == b"1"
    finally:
        await client.aclose()


async def test_wait_counts_replicas_and_degrades_without_them(redis_server: str,
                                                              sentinel_group: SentinelGroup) -> None:
    lone = pooled_client(redis_server, 2, 5.0)
    grouped = pooled_client(_spec(sentinel_group), 2, 5.0)
    try:
        ack = ReplicaAck(1, 100, retry_s=60)
        async with pinned(lone) as conn:
            await conn.set("x", 1)
            assert not await ack.wait(conn)  # no replica: times out once ...
            assert not await ack.wait(conn)  # ... then skips for retry_s
        assert ack.figures.timeouts == 1 and ack.figures.skipped == 1 and ack.acked is False
        two = ReplicaAck(2, 2000)
        async with pinned(grouped) as conn:
            await conn.set("x", 1)
            assert await two.wait(conn) and two.acked
        assert not ReplicaAck.of(redis_server).enabled and ReplicaAck.of(_spec(sentinel_group)).enabled
    finally:
        await lone.aclose()
        await grouped.aclose()


async def test_pinned_runs_on_one_connection(redis_server: str) -> None:
    client = pooled_client(redis_server, 4, 5.0)
    try:
        async with pinned(client) as conn:
            first = await conn.client_id()
            async with conn.pipeline(transaction=True) as pipe:
                pipe.client_id()
                pipe.set("y", 2)
                (inside, _) = await pipe.execute()
            assert await conn.client_id() == first == inside
        assert isinstance(client, aioredis.Redis) and client.connection_pool.in_use == 0  # type: ignore[attr-defined]
    finally:
        await client.aclose()


def test_up_passes_sentinel_options_by_environment() -> None:
    from pagedserve.launch.up import _sentinel_env, add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    env = _sentinel_env(parser.parse_args(["--redis-sentinel", "a:1,b:2", "--redis-sentinel-master", "m",
                                           "--redis-password", "pw"]))
    assert env == {"PAGEDSERVE_REDIS_SENTINEL": "a:1,b:2", "PAGEDSERVE_REDIS_SENTINEL_MASTER": "m",
                   "PAGEDSERVE_REDIS_PASSWORD": "pw", "PAGEDSERVE_REDIS_CLUSTER": ""}
    # not inherited
    assert _sentinel_env(parser.parse_args([])) == {"PAGEDSERVE_REDIS_SENTINEL": "", "PAGEDSERVE_REDIS_CLUSTER": ""}
    env = _sentinel_env(parser.parse_args(["--redis-cluster", "a:1,b:2"]))
    assert env == {"PAGEDSERVE_REDIS_SENTINEL": "", "PAGEDSERVE_REDIS_CLUSTER": "a:1,b:2"}
