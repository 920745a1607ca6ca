"""Redis Cluster's hash slots, for the code that writes several keys at once: which slot a key
is on, transactions that stay within one slot (`SlotBatch`, `slot_pipeline`), and a connection
pinned to the master of one slot (`pinned_to`) so that a `WAIT` after a write confirms that write,
following a slot migration's ASK and TRYAGAIN (redis-py's cluster client follows them only for
the plain commands it routes itself).

On a cluster a MULTI/EXEC or a script may only touch keys of one slot (Redis answers CROSSSLOT
otherwise); `common.protocol.Keys` gives every group of keys written together one hash tag. On
a single Redis (a URL or Sentinel) everything here is what it was: one transaction, the
client's own pinned connection. Torch-free."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot
from redis.exceptions import AskError, ClusterDownError, ExecAbortError, RedisError, ResponseError, TryAgainError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from common.redis_conn import NO_RETRY, pinned

# replies of a node that does not (or no longer) serve a slot, or a cluster in the middle of a
# change: nothing was written, the same write may go again once the slot map is refreshed
_MOVED = ("MOVED ", "ASK ", "TRYAGAIN", "CLUSTERDOWN", "EXECABORT")
# a pinned script or transaction answered TRYAGAIN (its keys split between the two nodes of a
# slot migration) is sent again this many times in all, pausing a little longer each time
TRYAGAIN_TRIES = 5
TRYAGAIN_PAUSE_S = 0.05


def is_cluster(client: Any) -> bool:
    """True for a Redis Cluster client (`common.redis_conn` makes one for ``--redis-cluster``)."""
    return isinstance(client, RedisCluster)


def slot_of(key: str | bytes) -> int:
    """The hash slot (0..16383) of `key`, by its hash tag when it has one."""
    return int(key_slot(key.encode() if isinstance(key, str) else key))


def slot_moved(exc: BaseException) -> bool:
    """True when `exc` says the slot is served elsewhere now or the cluster is changing
    (MOVED, ASK, TRYAGAIN, CLUSTERDOWN, or a transaction aborted by one of them): nothing
    was written. redis-py raises its own classes for these (without the word in the message),
    and a script's error carries the reply's text."""
    if isinstance(exc, (AskError, TryAgainError, ClusterDownError, ExecAbortError)):
        return True
    return isinstance(exc, ResponseError) and any(mark in str(exc) for mark in _MOVED)


def never_connected(exc: BaseException) -> bool:
    """True when `exc` is a connection that could not be opened (refused, unreachable): no
    command went out on it."""
    return isinstance(exc, RedisConnectionError) and "connecting to" in str(exc)


class SlotBatch:
    """Commands queued as on a MULTI/EXEC pipeline (``batch.set(...)``, ``batch.delete(...)``;
    the first argument of each is its key): `execute` runs them in one transaction on a single
    Redis, or in one transaction per hash slot on a cluster, in the order each slot first
    appears, and returns the replies in queue order."""

    def __init__(self, client: aioredis.Redis) -> None:
        self.client = client
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)

        def queue(*args: Any, **kwargs: Any) -> SlotBatch:
            self.calls.append((name, args, kwargs))
            return self
        return queue

    def slots(self) -> dict[int, list[int]]:
        """Queue positions of the commands, by the slot of their key."""
        groups: dict[int, list[int]] = {}
        for i, (_, args, _) in enumerate(self.calls):
            groups.setdefault(slot_of(args[0]), []).append(i)
        return groups

    async def execute(self) -> list[Any]:
        """The replies. On a cluster a slot whose master fails does not stop the others' writes
        (a heartbeat's hash is still refreshed while its model's master is being replaced): the
        first error is raised once every slot was tried."""
        groups = self.slots() if is_cluster(self.client) else {0: list(range(len(self.calls)))}
        replies: list[Any] = [None] * len(self.calls)
        failed: Exception | None = None
        for positions in groups.values():
            try:
                async with slot_pipeline(self.client, self.calls[positions[0]][1][0]) as pipe:
                    for i in positions:
                        name, args, kwargs = self.calls[i]
                        getattr(pipe, name)(*args, **kwargs)
                    for i, reply in zip(positions, await pipe.execute(), strict=True):
                        replies[i] = reply
            except (RedisError, OSError) as exc:
                if len(groups) == 1:
                    raise
                failed = failed or exc
        if failed is not None:
            raise failed
        return replies


@contextlib.asynccontextmanager
async def slot_pipeline(client: aioredis.Redis, key: str) -> AsyncIterator[Pipeline]:
    """A MULTI/EXEC pipeline for the slot of `key`: the client's own on a single Redis; on a
    cluster, a plain one on a connection pinned to the slot's master (`pinned_to`), so WATCH
    and the commands run right after it behave as on a single Redis (redis-py's cluster
    pipeline resolves every queued command's slot on a private event loop in a thread)."""
    if not is_cluster(client):
        async with client.pipeline(transaction=True) as pipe:
            yield pipe
        return
    async with pinned_to(client, key) as conn, conn.pipeline(transaction=True) as pipe:
        yield pipe


class _Asking:
    """A connection to the node an ASK named, for the rest of one pinned operation: that node
    serves a slot it is importing only to a command right after ASKING (outside a transaction
    the flag lasts one command; inside MULTI, up to EXEC), so every command, or a transaction's
    MULTI, goes out after one, whose OK is read off before the command's own reply."""

    def __init__(self, connection: Any) -> None:
        self.connection = connection
        self.unread = 0  # ASKING replies still to read

    def __getattr__(self, name: str) -> Any:
        return getattr(self.connection, name)

    async def send_command(self, *args: Any, **kwargs: Any) -> None:
        await self.send_packed_command(self.connection.pack_command(*args), kwargs.get("check_health", True))

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        chunks = [command.encode() if isinstance(command, str) else command] \
            if isinstance(command, (str, bytes)) else list(command)
        await self.connection.send_packed_command([*self.connection.pack_command("ASKING"), *chunks], check_health)
        self.unread += 1

    async def read_response(self, *args: Any, **kwargs: Any) -> Any:
        while self.unread:
            self.unread -= 1
            await self.connection.read_response()
        return await self.connection.read_response(*args, **kwargs)


class _NodeConnection:
    """The pool of a client pinned to one connection of a cluster node (never handed back here:
    `pinned_to` returns it to its node). After an ASK (`redirect`), the connection is one to
    the node the ASK named, used through `_Asking`."""

    def __init__(self, cluster: RedisCluster, connection: Any) -> None:
        self.cluster = cluster
        self.connection = connection
        self.connection_kwargs: dict[str, Any] = {}
        self.redirected: tuple[Any, Any, Any] | None = None  # (node, its connection, that one's retry) after an ASK

    async def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        return self.connection

    async def release(self, connection: Any) -> None:
        return None

    def redirect(self, exc: AskError) -> bool:
        """Go on, for the rest of the operation, on a connection to the node `exc` names, each
        command after ASKING. False (the caller raises) after an earlier redirect, or when that
        node is not known yet: the slot map is refreshed and the caller's next attempt retries."""
        if self.redirected is not None:
            return False
        node = self.cluster.get_node(exc.host, exc.port)
        if node is None:
            self.cluster._request_refresh()
            return False
        connection = node.acquire_connection()
        self.redirected = (node, connection, connection.retry)
        connection.retry = NO_RETRY
        self.connection = _Asking(connection)
        return True

    async def hand_back(self, failed: bool) -> None:
        """Return the redirect's connection to its node (the one pinned first is `pinned_to`'s);
        after a failure, or with a reply left unread, closed first: it is not reusable."""
        if self.redirected is not None:
            node, connection, retry = self.redirected
            self.redirected = None
            try:
                if failed or (isinstance(self.connection, _Asking) and self.connection.unread):
                    await connection.disconnect()
            finally:
                connection.retry = retry
                node.release(connection)

    def get_encoder(self) -> Any:
        return self.connection.encoder

    def get_protocol(self) -> Any:
        return getattr(self.connection, "protocol", None)

    async def disconnect(self, *args: Any, **kwargs: Any) -> None:
        return None

    async def aclose(self) -> None:
        return None


def _redirect(client: aioredis.Redis, exc: AskError) -> bool:
    """`_NodeConnection.redirect` of a pinned client's pool."""
    pool = client.connection_pool
    return isinstance(pool, _NodeConnection) and pool.redirect(exc)


class _SlotPipeline(Pipeline):
    """A pinned transaction that follows one ASK (the slot is being migrated and a key it
    touches is on the target already) by sending it again, after ASKING, to the target, and
    sends it again after TRYAGAIN (its keys are split between the two nodes for a moment). A
    transaction under WATCH is not sent again: its watch was on the first node."""

    async def immediate_execute_command(self, *args: Any, **options: Any) -> Any:
        try:
            return await super().immediate_execute_command(*args, **options)
        except AskError as exc:
            if self.watching or not _redirect(self, exc):
                raise
        self.connection = await self.connection_pool.get_connection()
        return await super().immediate_execute_command(*args, **options)

    async def _execute_transaction(self, connection: Any, commands: Any, raise_on_error: bool) -> Any:
        for attempt in range(TRYAGAIN_TRIES):
            try:
                return await super()._execute_transaction(connection, commands, raise_on_error)
            except AskError as exc:
                if self.watching or not _redirect(self, exc):
                    raise
                connection = self.connection = await self.connection_pool.get_connection()
            except TryAgainError:
                if self.watching or attempt == TRYAGAIN_TRIES - 1:
                    raise
                await asyncio.sleep(TRYAGAIN_PAUSE_S * (attempt + 1))
        raise TryAgainError("TRYAGAIN the slot kept moving")


class _SlotClient(aioredis.Redis):
    """A client pinned to the master of one slot whose commands and scripts follow one ASK to
    the node importing the slot, and are sent again after TRYAGAIN (a script whose keys are
    split between the two nodes ran nothing); its pipelines are `_SlotPipeline`s."""

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        for attempt in range(TRYAGAIN_TRIES):
            try:
                return await super().execute_command(*args, **options)
            except AskError as exc:
                if not _redirect(self, exc):
                    raise
            except TryAgainError:
                if attempt == TRYAGAIN_TRIES - 1:
                    raise
                await asyncio.sleep(TRYAGAIN_PAUSE_S * (attempt + 1))
        raise TryAgainError("TRYAGAIN the slot kept moving")

    def pipeline(self, transaction: bool = True, shard_hint: Any = None) -> _SlotPipeline:
        return _SlotPipeline(self.connection_pool, self.response_callbacks, transaction, shard_hint)


@contextlib.asynccontextmanager
async def pinned_to(client: aioredis.Redis, key: str) -> AsyncIterator[aioredis.Redis]:
    """`common.redis_conn.pinned` on the master that owns `key`'s slot: a plain client whose
    commands, scripts and transactions all run on one connection to that master, without
    retries, so a `WAIT` there confirms exactly what it wrote. On a cluster, a lost connection
    or a reply saying the slot moved asks the cluster client to refresh its slot map (the
    caller's next attempt goes to the slot's new master). While the slot is being migrated, an
    ASK moves the rest of the operation to the importing node (its `WAIT` included, which then
    confirms the writes made there), and TRYAGAIN sends a script or transaction again."""
    if not is_cluster(client):
        async with pinned(client) as conn:
            yield conn
        return
    cluster: RedisCluster = client  # type: ignore[assignment]
    await cluster.initialize()
    node = cluster.get_node_from_key(key)
    if node is None:
        raise RedisConnectionError(f"no master serves the slot of {key!r}")
    connection = node.acquire_connection()
    saved, connection.retry = connection.retry, NO_RETRY
    pool = _NodeConnection(cluster, connection)
    failed = True
    try:
        yield _SlotClient(connection_pool=pool)  # type: ignore[arg-type]
        failed = False
    except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
        cluster._request_refresh(last_failed_node_name=node.name)
        await connection.disconnect()
        if isinstance(exc, RedisConnectionError):
            raise  # NotReplicated among them: its caller settles the write
        raise RedisConnectionError(f"lost the connection to {node.name}: {exc}") from exc
    except ResponseError as exc:
        if slot_moved(exc):
            cluster._request_refresh()
        raise
    finally:
        await pool.hand_back(failed)
        connection.retry = saved
        node.release(connection)
