"""What a client is told about a Redis failure: one mapping for every raise site.

Redis at `maxmemory` with `noeviction` answers writes (and the gateway's scripts) with an OOM
error; that is not an outage, and its raw text names script hashes (`f_<sha>`). Clients get
"Redis is out of memory" for it, "cannot reach Redis: ..." for everything else."""

from __future__ import annotations

from redis.exceptions import OutOfMemoryError, RedisError, ResponseError

OUT_OF_MEMORY = "Redis is out of memory (maxmemory reached); retry later"
CODE_UNAVAILABLE = "redis_unavailable"
CODE_OUT_OF_MEMORY = "redis_out_of_memory"


def is_out_of_memory(exc: BaseException) -> bool:
    """True for Redis's OOM answer, raised directly or from inside a script."""
    if isinstance(exc, OutOfMemoryError):
        return True
    if not isinstance(exc, ResponseError):
        return False
    text = str(exc)
    return text.startswith("OOM") or "OOM command not allowed" in text \
        or text.startswith("command not allowed when used memory")


def redis_error(exc: BaseException) -> tuple[str, str]:
    """(message, code) for a client: no script hashes, no Redis internals for OOM."""
    if is_out_of_memory(exc):
        return OUT_OF_MEMORY, CODE_OUT_OF_MEMORY
    return f"cannot reach Redis: {exc}", CODE_UNAVAILABLE


__all__ = ["CODE_OUT_OF_MEMORY", "CODE_UNAVAILABLE", "OUT_OF_MEMORY", "RedisError", "is_out_of_memory",
           "redis_error"]
