"""Redis connections shared by the engine worker and the gateway: a connection pool that
waits (bounded) instead of failing when busy, and says how busy it is; URLs with their
password masked for logs; the dataset epoch that tells a restart without persistence.

Pool pressure is not an outage: redis-py's default pool raises "Too many connections" the
moment a burst needs more connections than its limit. `MeteredPool` makes callers queue for
up to `timeout` seconds and raises `PoolBusy` (not a connection error) when that runs out.
Torch-free."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.asyncio.connection import BlockingConnectionPool
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError


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


def pooled_client(url: str, max_connections: int, wait_timeout_s: float, **kwargs: Any) -> aioredis.Redis:
    """A client on a `MeteredPool` for `url` (kwargs: socket timeouts, retry, ...)."""
    pool = MeteredPool.from_url(url, max_connections=max_connections, timeout=wait_timeout_s, **kwargs)
    return aioredis.Redis(connection_pool=pool)


def redact_url(url: str) -> str:
    """`url` with its password (and user) replaced by ``***``: safe for logs and error bodies."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable redis url>"
    if parts.password is None and parts.username is None:
        return url
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, f"***@{host}", parts.path, parts.query, parts.fragment))


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
