"""Redis at maxmemory (noeviction): requests get 503 "Redis is out of memory", never the raw
script error with its hash; connection failures keep "cannot reach Redis"."""

from __future__ import annotations

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError, ResponseError

from gateway.broker.redis_errors import CODE_OUT_OF_MEMORY, CODE_UNAVAILABLE, redis_error
from tests.fixtures.gateway import MODEL, Gateway, gateway

__all__ = ["gateway"]


async def _fill(gw: Gateway) -> None:
    """Fill Redis, then lower maxmemory far under what it uses: every write is refused (OOM).
    The margin (2 MiB) is far more than Redis gives back on its own meanwhile (it shrinks idle
    clients' query buffers: with a 64 KiB margin that once let the request's write through)."""
    await gw.redis.config_set("maxmemory-policy", "noeviction")
    for i in range(256):
        await gw.redis.set(f"filler:{i}", b"x" * 16_384)
    used = int((await gw.redis.info("memory"))["used_memory"])
    await gw.redis.config_set("maxmemory", used - (2 << 20))
    try:
        await gw.redis.set("probe", "1")
        raise AssertionError("Redis accepted a write past maxmemory")
    except OutOfMemoryError:
        pass


async def test_submit_at_maxmemory_says_out_of_memory(gateway: Gateway) -> None:
    await _fill(gateway)
    try:
        resp = await gateway.client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi"})
        body = await resp.json()
        assert resp.status == 503, body
        error = body["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert "out of memory" in error["message"] and "maxmemory" in error["message"]
        assert error["code"] == CODE_OUT_OF_MEMORY
        for internal in ("f_", "script", "user_script", "cannot reach"):
            assert internal not in error["message"], error["message"]
        resp = await gateway.client.post("/v1/chat/completions",
                                         json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]})
        assert resp.status == 503 and (await resp.json())["error"]["code"] == CODE_OUT_OF_MEMORY
    finally:
        await gateway.redis.config_set("maxmemory", 0)
    await gateway.redis.flushall()
    await gateway.engine.beat()
    resp = await gateway.client.get("/v1/models")
    assert resp.status == 200


def test_mapper_keeps_connection_errors_and_hides_script_text() -> None:
    message, code = redis_error(RedisConnectionError("Connection refused"))
    assert message == "cannot reach Redis: Connection refused" and code == CODE_UNAVAILABLE
    old = ResponseError("OOM command not allowed when used memory > 'maxmemory'. "
                        "Error running script (call to f_0a9f75e991483d02789696e4c90d26c10395863e)")
    for exc in (old, OutOfMemoryError("command not allowed when used memory > 'maxmemory'. script: abc")):
        message, code = redis_error(exc)
        assert code == CODE_OUT_OF_MEMORY and "f_" not in message and "script" not in message
    assert redis_error(ResponseError("WRONGTYPE"))[1] == CODE_UNAVAILABLE
