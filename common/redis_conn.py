"""Redis connections shared by the engine worker and the gateway, the one factory every client
of both sides is made by (`pooled_client`, `single_client`, from a URL or a `RedisSpec`): a
connection pool that waits (bounded) instead of failing when busy, and says how busy it is;
URLs with their password masked for logs; the dataset epoch that tells a restart without
persistence; `WAIT` after writes that must survive a failover (`ReplicaAck`, on the connection
that wrote: `pinned`); which master is in use (`MasterView`).

With Redis Sentinel every (re)connection asks the sentinels for the current master, and a
READONLY reply (a demoted master) drops the connection (redis-py turns it into a connection
error), so the caller's next attempt, or the client's own retry, asks again. A failover keeps
the dataset (the epoch key replicates with the rest): it is not a data loss.

With Redis Cluster (`RedisSpec.cluster`) the client is redis-py's `RedisCluster`, which finds
each key's master by its slot and follows MOVED/ASK redirects and failovers; writes that must
survive are sent, with their WAIT, on a connection pinned to the slot's master
(`common.redis_slots.pinned_to`).

Pool pressure is not an outage: redis-py's default pool raises "Too many connections" the
moment a burst needs more connections than its limit. `MeteredPool` makes callers queue for
up to `timeout` seconds and raises `PoolBusy` (not a connection error) when that runs out.
Torch-free."""

from __future__ import annotations

import collections
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import BlockingConnectionPool, ConnectionPool
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import (
    Sentinel,
    SentinelConnectionPool,
    SentinelManagedConnection,
    SentinelManagedSSLConnection,
)
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ReadOnlyError, RedisError, ResponseError

from common.redis_spec import RedisSpec
from common.redis_spec import redact_url as redact_url  # re-exported: its callers import it from here


class PoolBusy(RedisError):
    """Every pooled connection stayed in use for the whole bounded wait (overload, not an outage)."""


@dataclass(slots=True)
class PoolFigures:
    """What a pool has been through: waits for a connection and their total duration."""

    waiting: int = 0
    acquired: int = 0
    timeouts: int = 0
    wait_seconds: float = 0.0
    max_wait_seconds: float = 0.0
    waits: list[float] = field(default_factory=list)  # drained by the metrics collector


class MeteredPool(BlockingConnectionPool):
    """A blocking pool of at most `max_connections` that counts who waits and for how long."""

    def __init__(self, max_connections: int, timeout: float, **kwargs: Any) -> None:
        super().__init__(max_connections=max_connections, timeout=timeout, **kwargs)
        self.figures = PoolFigures()

    @property
    def in_use(self) -> int:
        return len(self._in_use_connections)

    async def get_connection(self, command_name: Any = None, *keys: Any, **options: Any) -> Any:
        figures = self.figures
        figures.waiting += 1
        start = time.monotonic()
        try:
            connection = await super().get_connection()
        except RedisConnectionError as exc:
            if exc.args and exc.args[0] == "No connection available.":
                figures.timeouts += 1
                raise PoolBusy(f"all {self.max_connections} Redis connections busy for {self.timeout}s") from exc
            raise
        finally:
            figures.waiting -= 1
        waited = time.monotonic() - start
        figures.acquired += 1
        figures.wait_seconds += waited
        figures.max_wait_seconds = max(figures.max_wait_seconds, waited)
        if len(figures.waits) < 10_000:
            figures.waits.append(waited)
        return connection


class _SentinelPool(SentinelConnectionPool):
    """A pool on the master the sentinels report; it owns its `Sentinel` (closed with it)."""

    async def aclose(self) -> None:
        try:
            await super().aclose()
        finally:
            await self.sentinel_manager.aclose()


class _FollowMaster(SentinelManagedConnection):
    """Asks the sentinels for the master on every reconnect. redis-py (8.2) reconnects a dropped
    connection in its send path (`connect_check_health`), which skips
    `SentinelManagedConnection.connect` and goes back to the address it had: after a master
    switch, the retries of a command refused READONLY all went to the demoted node (rate-limit
    takes and registry reads failed where a fresh connection would have found the new master)."""

    _resolving = False  # inside connect_to: the address was just asked for

    async def connect_to(self, address: Any) -> None:
        self._resolving = True
        try:
            await super().connect_to(address)
        finally:
            self._resolving = False

    async def connect_check_health(self, check_health: bool = True, retry_socket_connect: bool = True) -> None:
        if not self.is_connected and not self._resolving and self.connection_pool.is_master:
            self.host, self.port = await self.connection_pool.get_master_address()
        await super().connect_check_health(check_health=check_health, retry_socket_connect=retry_socket_connect)

    async def read_response(self, *args: Any, **kwargs: Any) -> Any:
        """A script's write refused READONLY by a demoted master (Redis 6 wraps it in "Error running
        script", which redis-py does not take for a ReadOnlyError) drops the connection and raises
        the ConnectionError redis-py raises for a plain READONLY, so the next connect asks the sentinels."""
        try:
            return await super().read_response(*args, **kwargs)
        except ResponseError as exc:
            if not self.connection_pool.is_master or not _script_readonly(exc):
                raise
            await self.disconnect()
            raise RedisConnectionError("The previous master is now a slave") from exc


class _FollowMasterSSL(_FollowMaster, SentinelManagedSSLConnection):
    """`_FollowMaster` over TLS."""


class _MeteredSentinelPool(_SentinelPool, MeteredPool):
    """`MeteredPool`'s bounded wait and figures on a Sentinel-managed master."""


def _spec(spec: RedisSpec | str) -> RedisSpec:
    return RedisSpec(url=spec) if isinstance(spec, str) else spec


def _sentinel(spec: RedisSpec, kwargs: dict[str, Any]) -> Sentinel:
    """A `Sentinel` for `spec`; the sentinels get the socket timeouts of `kwargs`."""
    sentinel_kwargs: dict[str, Any] = {k: v for k, v in kwargs.items() if k.startswith("socket_")}
    sentinel_kwargs.setdefault("socket_connect_timeout", 2.0)
    sentinel_kwargs.setdefault("socket_timeout", 2.0)
    if spec.sentinel_password:
        sentinel_kwargs["password"] = spec.sentinel_password
    if spec.tls:
        sentinel_kwargs["ssl"] = True
    master_kwargs: dict[str, Any] = {"db": spec.db}
    if spec.password:
        master_kwargs["password"] = spec.password
    if spec.username:
        master_kwargs["username"] = spec.username
    if spec.tls:
        master_kwargs["ssl"] = True
    return Sentinel(list(spec.sentinels), sentinel_kwargs=sentinel_kwargs, **master_kwargs)


class _LastFreeFirst(collections.deque[Any]):
    """A cluster node's free connections, handed out last released first."""

    def popleft(self) -> Any:
        return self.pop()


class ClusterClient(RedisCluster):
    """redis-py's `RedisCluster`, closed like a plain client (``aclose(close_connection_pool=...)``),
    whose ASK redirects land.

    redis-py follows an ASK by sending ASKING, then the command, each on a connection taken from
    the node's free list and put back (first in, first out): with two or more free connections
    the command goes out on another connection than its ASKING, the importing node answers it
    MOVED back to the source, and the command fails once its redirects run out. Every node
    `get_node` returns (that is how the ASK's node is found) hands out the connection released
    last: the one the ASKING went out on (nothing runs between the two on the event loop)."""

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        await super().aclose()

    def get_node(self, host: str | None = None, port: int | None = None,
                 node_name: str | None = None) -> ClusterNode | None:
        node = super().get_node(host, port, node_name)
        if node is not None and not isinstance(node._free, _LastFreeFirst):
            node._free = _LastFreeFirst(node._free, maxlen=node._free.maxlen)
        return node


def _cluster(spec: RedisSpec, max_connections: int, kwargs: dict[str, Any]) -> aioredis.Redis:
    """A cluster client for `spec`: at most `max_connections` to each node."""
    options = dict(kwargs)
    if spec.password:
        options["password"] = spec.password
    if spec.username:
        options["username"] = spec.username
    if spec.tls:
        options["ssl"] = True
    nodes = [ClusterNode(host, port) for host, port in spec.cluster]
    return ClusterClient(startup_nodes=nodes, max_connections=max_connections, **options)  # type: ignore[return-value]


def pooled_client(spec: RedisSpec | str, max_connections: int, wait_timeout_s: float,
                  **kwargs: Any) -> aioredis.Redis:
    """A client on a `MeteredPool` for `spec` (a URL, or a `RedisSpec`: then with sentinels, on
    the master they report, followed across failovers; with a cluster, a `ClusterClient`, which
    holds up to `max_connections` per node and does not queue). kwargs: socket timeouts, retry, ..."""
    spec = _spec(spec)
    if spec.uses_cluster:
        return _cluster(spec, max_connections, kwargs)
    if not spec.uses_sentinel:
        pool = MeteredPool.from_url(spec.url, max_connections=max_connections, timeout=wait_timeout_s, **kwargs)
        return aioredis.Redis(connection_pool=pool)
    return _sentinel(spec, kwargs).master_for(spec.master, connection_pool_class=_MeteredSentinelPool,
                                              connection_class=_following(spec), max_connections=max_connections,
                                              timeout=wait_timeout_s, **kwargs)


def single_client(spec: RedisSpec | str, **kwargs: Any) -> aioredis.Redis:
    """A client on redis-py's plain pool for `spec` (a dedicated reader, a subscription)."""
    spec = _spec(spec)
    if spec.uses_cluster:
        return _cluster(spec, 100, kwargs)
    if not spec.uses_sentinel:
        return aioredis.Redis.from_url(spec.url, **kwargs)
    return _sentinel(spec, kwargs).master_for(spec.master, connection_pool_class=_SentinelPool,
                                              connection_class=_following(spec), **kwargs)


def _following(spec: RedisSpec) -> type[SentinelManagedConnection]:
    return _FollowMasterSSL if spec.tls else _FollowMaster


def master_address(client: aioredis.Redis) -> str:
    """``host:port`` of the master `client` connects to (with Sentinel: the last one reported)."""
    pool = client.connection_pool
    if isinstance(pool, SentinelConnectionPool):
        address = pool.master_address
        return "unknown" if address is None else f"{address[0]}:{address[1]}"
    kwargs = pool.connection_kwargs
    if "path" in kwargs:
        return str(kwargs["path"])
    return f"{kwargs.get('host', 'localhost')}:{kwargs.get('port', 6379)}"


NO_RETRY = Retry(NoBackoff(), 0)  # a pinned connection's: see `pinned`


class _PinnedPool:
    """Hands every command of a client the same connection and never takes it back."""

    def __init__(self, pool: ConnectionPool, connection: Any) -> None:
        self._pool = pool
        self._connection = connection

    async def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        return self._connection

    async def release(self, connection: Any) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pool, name)


@contextlib.asynccontextmanager
async def pinned(client: aioredis.Redis) -> AsyncIterator[aioredis.Redis]:
    """A client whose commands, scripts and pipelines all run on one connection of `client`'s
    pool, without redis-py's retries (a retry would reconnect, maybe to a new master, and a
    WAIT there would confirm nothing): a WAIT confirms only the writes of its own connection."""
    pool = client.connection_pool
    connection = await pool.get_connection()
    saved, connection.retry = connection.retry, NO_RETRY
    try:
        yield aioredis.Redis(connection_pool=_PinnedPool(pool, connection))  # type: ignore[arg-type]
    finally:
        connection.retry = saved
        await pool.release(connection)


def _script_readonly(exc: BaseException) -> bool:
    """A script's write refused READONLY, as Redis before 7 reports it ("Error running script ...
    -READONLY You can't write against a read only replica")."""
    return isinstance(exc, ResponseError) and "-READONLY " in str(exc)


def refused_by_demoted_master(exc: BaseException) -> bool:
    """True when `exc` is a write refused with READONLY: the node was the master and is a replica
    now (a switch or a failover), so nothing was written and the write may go to the new master.
    redis-py raises ReadOnlyError (Redis 7, or a plain command), a ResponseError naming it (a
    script's write on Redis 6), or, on a Sentinel-managed master, a ConnectionError while handling
    either (the connection is dropped so the next one asks the sentinels again)."""
    if isinstance(exc, ReadOnlyError) or _script_readonly(exc):
        return True
    return isinstance(exc, RedisConnectionError) and any(
        isinstance(e, ReadOnlyError) or _script_readonly(e) for e in (exc.__cause__, exc.__context__)
        if e is not None)


class NotReplicated(RedisConnectionError):
    """The connection dropped between a write and its WAIT: the write may be lost in a failover."""


@dataclass(slots=True)
class AckFigures:
    """What the WAITs of one process cost and how they ended."""

    waits: int = 0
    acked: int = 0
    timeouts: int = 0
    skipped: int = 0
    lost: int = 0
    wait_seconds: float = 0.0
    max_wait_seconds: float = 0.0


class ReplicaAck:
    """``WAIT replicas timeout`` after a write that must survive a failover. A write a replica
    acknowledged survives: Sentinel promotes the replica with the largest replication offset.

    A WAIT that times out (no replica attached, or one lagging) leaves the master in use
    unacknowledged (`acked` False, /health says so) and is not asked again for `retry_s`, so a
    master without replicas costs one timeout every `retry_s`, not one per write."""

    def __init__(self, replicas: int, timeout_ms: int, retry_s: float = 5.0) -> None:
        self.replicas = replicas
        self.timeout_ms = timeout_ms
        self.retry_s = retry_s
        self.acked: bool | None = None if replicas > 0 else False
        self.figures = AckFigures()
        self._skip_until = 0.0

    @classmethod
    def of(cls, spec: RedisSpec | str) -> ReplicaAck:
        spec = _spec(spec)
        return cls(spec.replicas_to_wait, spec.wait_timeout_ms)

    @property
    def enabled(self) -> bool:
        return self.replicas > 0

    async def wait(self, conn: aioredis.Redis) -> bool:
        """WAIT on `conn` (a `pinned` client that just wrote). True when enough replicas have
        every write of that connection. Raises NotReplicated when the connection was lost since
        the write (then nothing is known: the caller re-sends), RedisError when WAIT fails."""
        if not self.enabled:
            return False
        start = time.monotonic()
        if start < self._skip_until:
            self.figures.skipped += 1
            return False
        connection = await conn.connection_pool.get_connection()
        writer = getattr(connection, "_writer", None)
        if writer is None:
            self.figures.lost += 1
            raise NotReplicated("the connection closed after the write")
        try:
            got = int(await conn.execute_command("WAIT", self.replicas, self.timeout_ms))
        except RedisConnectionError as exc:
            self.figures.lost += 1
            raise NotReplicated(f"connection lost before the replicas acknowledged: {exc}") from exc
        if getattr(connection, "_writer", None) is not writer:  # reconnected in between: confirms nothing
            self.figures.lost += 1
            raise NotReplicated("reconnected between the write and WAIT")
        waited = time.monotonic() - start
        figures = self.figures
        figures.waits += 1
        figures.wait_seconds += waited
        figures.max_wait_seconds = max(figures.max_wait_seconds, waited)
        self.acked = got >= self.replicas
        if self.acked:
            figures.acked += 1
        else:
            figures.timeouts += 1
            self._skip_until = time.monotonic() + self.retry_s
        return self.acked


class MasterView:
    """Which Redis this process writes to: address, run id (a new one after a failover or a
    restart), replicas attached. `refresh` returns True when the run id changed."""

    def __init__(self) -> None:
        self.address = "unknown"
        self.run_id: str | None = None
        self.replicas = 0
        self.changes = 0

    async def refresh(self, client: aioredis.Redis) -> bool:
        if isinstance(client, RedisCluster):
            return await self._refresh_cluster(client)
        server = await client.info("server")
        replication = await client.info("replication")
        self.address = master_address(client)
        self.replicas = int(replication.get("connected_slaves", 0))
        run_id = str(server.get("run_id", ""))
        changed = self.run_id is not None and run_id != self.run_id
        self.changes += changed
        self.run_id = run_id
        return changed

    async def _refresh_cluster(self, client: RedisCluster) -> bool:
        """A cluster's masters: their addresses, run ids (one changes when a replica takes over)
        and replicas, each sorted by address."""
        await client.initialize()
        primaries = sorted(client.get_primaries(), key=lambda node: node.name)
        run_ids, replicas = [], 0
        for node in primaries:
            server = await client.info("server", target_nodes=node)
            replication = await client.info("replication", target_nodes=node)
            run_ids.append(str(server.get("run_id", "")))
            replicas += int(replication.get("connected_slaves", 0))
        self.address = ",".join(node.name for node in primaries)
        self.replicas = replicas
        run_id = ",".join(run_ids)
        changed = self.run_id is not None and run_id != self.run_id
        self.changes += changed
        self.run_id = run_id
        return changed


class Epoch:
    """The token in ``{prefix}:epoch``. Every process adopts the token it first sees (setting
    one when there is none); a later different or missing token means Redis lost its data."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.token: str | None = None

    async def check(self, client: aioredis.Redis) -> bool:
        """True when the dataset changed since the token was adopted (then adopts the new one)."""
        current = await client.get(self.key)
        if current is None:
            await client.set(self.key, uuid.uuid4().hex, nx=True)
            current = await client.get(self.key)
        token = current.decode() if isinstance(current, bytes) else str(current)
        changed = self.token is not None and token != self.token
        self.token = token
        return changed
