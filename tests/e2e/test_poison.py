"""Property-based poison of every stream and channel a live engine and gateway read (real
redis-server, an engine process with the tiny model, a gateway process): random bytes, and
structurally valid messages with wrong fields, on the request stream, the abort channel, the
gateway's output stream and the engine heartbeat hashes. Whatever arrives, both processes keep
serving; every request entry that does not decode is dead-lettered (with its reason and raw
bytes) and acknowledged, never left pending; and once the traffic stops the engine holds no
KV block."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.protocol import REQUEST_FIELD, EngineRequest, Keys, ProtocolError
from common.sampling_params import SamplingParams
from pagedserve.launch.redis_server import RedisServer
from tests.e2e.support import EngineProcess, GatewayProcess, start_engines

MODEL = "tiny"
KEYS = Keys()
VALID_REQUEST = EngineRequest(id="poison-valid", gateway="no-such-gateway", model=MODEL, prompt_token_ids=[1, 2, 3],
                              params=SamplingParams(max_tokens=2), arrival=time.time()).encode()
HOSTILE: list[Any] = [None, True, -1, 2**64 - 1, -(2**63), 1.5, float("nan"), float("inf"), "",
                      "x" * 70_000, [], {}, [[1]], {"a": 1}, [-5], [2**40], b"\xff", [True, False]]
msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=12)
    | st.binary(max_size=12),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=10,
)


def _mutated_request(draw: st.DrawFn) -> bytes:
    obj = msgpack.unpackb(VALID_REQUEST)
    for name in draw(st.lists(st.sampled_from(sorted({*obj, "params"})), min_size=1, max_size=3, unique=True)):
        if name == "params" and draw(st.booleans()):
            field = draw(st.sampled_from(["n", "temperature", "max_tokens", "stop_token_ids", "logit_bias",
                                          "structured_output", "seed", "top_p", "best_of"]))
            obj["params"] = {**obj["params"], field: draw(st.sampled_from(HOSTILE))}
        elif draw(st.booleans()):
            obj[name] = draw(st.sampled_from(HOSTILE))
        else:
            obj.pop(name)
    return msgpack.packb(obj, use_bin_type=True)


def _unhashable_key() -> bytes:
    """A map whose key is an array: msgpack raises TypeError (unhashable) unpacking it."""
    return b"\x81\x92\x01\x02\x01"  # {[1, 2]: 1}


@st.composite
def poison(draw: st.DrawFn) -> tuple[str, Any]:
    target = draw(st.sampled_from(["request", "request", "request", "abort", "output", "heartbeat"]))
    shape = draw(st.sampled_from(["bytes", "msgpack", "mutated", "unhashable"]))
    if shape == "bytes":
        payload: Any = draw(st.binary(max_size=64))
    elif shape == "unhashable":
        payload = _unhashable_key()
    elif shape == "msgpack" or target != "request":
        value = draw(msgpack_values) if shape != "mutated" else {"v": 2, "ids": draw(st.sampled_from(HOSTILE))}
        payload = msgpack.packb(value, use_bin_type=True)
    else:
        payload = _mutated_request(draw)
    if target == "heartbeat":
        payload = {draw(st.sampled_from(["engine_id", "model", "time", "stat:running", "pool", "tables",
                                         "max_model_len", "x"])): draw(st.binary(max_size=24)) or b"?"
                   for _ in range(draw(st.integers(1, 4)))}
    return target, payload


def _undecodable(payload: bytes) -> bool:
    try:
        EngineRequest.decode(payload)
    except ProtocolError:
        return True
    return False


@pytest.fixture(scope="module")
def stack(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[tuple[redis.Redis, EngineProcess, GatewayProcess, dict[str, int]]]:
    log_dir = tmp_path_factory.mktemp("poison")
    with RedisServer() as server:
        [engine] = start_engines(tiny_llama_dir, server.url, log_dir, ["poison-0"], "--served-model-name", MODEL,
                                 "--kv-cache-memory", "4MiB")
        gateway = GatewayProcess(server.url, "poison-gw", log_dir).wait_healthy(60)
        client = redis.Redis.from_url(server.url)
        try:
            yield client, engine, gateway, {"dead": 0, "written": 0}
        finally:
            client.close()
            gateway.stop()
            engine.stop()


@settings(max_examples=200, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                 HealthCheck.data_too_large])
@given(poison())
def test_poison_never_kills_engine_or_gateway(stack: tuple[redis.Redis, EngineProcess, GatewayProcess,
                                                             dict[str, int]], item: tuple[str, Any]) -> None:
    client, engine, gateway, counts = stack
    target, payload = item
    if target == "request":
        if not _undecodable(payload):
            return  # a mutation that is still a valid request: not poison
        client.xadd(KEYS.requests(MODEL), {REQUEST_FIELD: payload})
        counts["dead"] += 1
    elif target == "abort":
        client.publish(KEYS.abort, payload)
    elif target == "output":
        client.xadd(KEYS.out(gateway.gateway_id), {REQUEST_FIELD: payload})
    else:
        key = KEYS.engine(f"poison-fake-{counts['written'] % 7}")
        client.delete(key)
        client.hset(key, mapping=payload)
        client.pexpire(key, 3000)
    counts["written"] += 1
    assert engine.proc.poll() is None, f"engine died on {target} {payload!r:.300}: {engine.log_tail()}"
    assert gateway.proc.poll() is None, f"gateway died on {target} {payload!r:.300}: {gateway.log_tail()}"


def test_after_the_poison_bad_entries_are_dead_lettered_and_the_engine_serves(
        stack: tuple[redis.Redis, EngineProcess, GatewayProcess, dict[str, int]]) -> None:
    client, engine, gateway, counts = stack
    # a request entry without the message field at all is poison too
    client.xadd(KEYS.requests(MODEL), {"not-m": b"x"})
    counts["dead"] += 1
    deadline = time.monotonic() + 60
    while client.xlen(KEYS.dead(MODEL)) < counts["dead"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert client.xlen(KEYS.dead(MODEL)) == counts["dead"] > 0
    last = client.xrevrange(KEYS.dead(MODEL), count=1)[0][1]
    assert b"reason" in last and last[REQUEST_FIELD.encode()] == b""
    while client.xpending(KEYS.requests(MODEL), KEYS.group)["pending"] and time.monotonic() < deadline:
        time.sleep(0.2)  # the ack goes out with the engine's next flush, after the dead-letter XADD
    assert client.xpending(KEYS.requests(MODEL), KEYS.group)["pending"] == 0
    body = json.dumps({"model": MODEL, "prompt": "ok", "max_tokens": 4, "temperature": 0, "ignore_eos": True})
    req = urllib.request.Request(f"{gateway.url}/v1/completions", body.encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        assert json.loads(resp.read())["usage"]["completion_tokens"] == 4
    stats = engine.wait_drained(timeout=60)
    assert stats["num_used_blocks"] == 0 and stats["dead_lettered"] == counts["dead"]
    assert engine.proc.poll() is None and gateway.proc.poll() is None
