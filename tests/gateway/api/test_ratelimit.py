"""Per-API-key rate limits on a real redis-server: the Lua buckets on an injected clock, and
the gateway's 429 (Retry-After, OpenAI body), x-ratelimit-* headers, refill and reload."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from gateway.api import ratelimit
from gateway.api.ratelimit import LIMITS_FILE, RateLimiter
from gateway.metrics import GatewayMetrics
from gateway.ratelimit_config import Limit, LimitsFile, key_hash
from tests.fixtures.gateway import MODEL, Gateway, open_live_gateway

SEC = 1_000_000  # microseconds
COMP = {"model": MODEL, "prompt": "Hello world", "max_tokens": 4}


def _limits(tmp_path: Path, data: dict[str, Any], name: str = "limits.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


async def _limiter(redis_url: str, tmp_path: Path, window: float = 60) -> tuple[RateLimiter, aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_url)
    path = _limits(tmp_path, {"window_seconds": window})
    return RateLimiter(client, "test", LimitsFile(path), GatewayMetrics()), client


async def test_buckets_on_an_injected_clock(redis_server: str, tmp_path: Path) -> None:
    limiter, client = await _limiter(redis_server, tmp_path)
    try:
        limit = Limit(requests=2, tokens=100)
        t0 = 1_000 * SEC
        first = await limiter.take("b", limit, 30, t0)
        assert first.allowed and first.remaining == (1, 70)
        assert first.reset_s == pytest.approx((30.0, 18.0))  # 1 of 2 per 60 s; 30 of 100 per 60 s
        assert (await limiter.take("b", limit, 60, t0)).remaining == (0, 10)
        refused = await limiter.take("b", limit, 5, t0)
        assert not refused.allowed and refused.kind == "requests" and refused.wait_s == pytest.approx(30.0)
        assert (await limiter.take("b", limit, 5, t0)).remaining == (0, 10)  # a refusal takes nothing
        t1 = t0 + 30 * SEC  # one request and 50 tokens refilled
        tokens = await limiter.take("b", limit, 70, t1)
        assert not tokens.allowed and tokens.kind == "tokens" and tokens.wait_s == pytest.approx(6.0)
        later = await limiter.take("b", limit, 70, t1 + 6 * SEC)
        assert later.allowed and later.remaining == (0, 0)
        assert (await limiter.take("b", limit, 1, t1 + 600 * SEC)).remaining == (1, 99)  # capped at the limit
        never = await limiter.take("b", limit, 101, t1 + 600 * SEC)
        assert not never.allowed and never.kind == "tokens" and never.wait_s == float("inf")
        assert (await limiter.take("other", limit, 1, t0)).remaining == (1, 99)  # buckets are per key
        only_tokens = await limiter.take("c", Limit(tokens=10), 4, t0)
        assert only_tokens.allowed and only_tokens.remaining[1] == 6
        assert await client.ttl(limiter.bucket_keys("b")[0]) > 0  # idle buckets expire
        assert not await client.exists(limiter.bucket_keys("c")[0])  # no bucket for an unlimited kind
    finally:
        await client.aclose()


async def test_redis_time_refills(redis_server: str, tmp_path: Path) -> None:
    """Without an injected clock the script uses Redis TIME: a 10 ms window refills."""
    limiter, client = await _limiter(redis_server, tmp_path, window=0.01)
    try:
        limit = Limit(requests=1)
        assert (await limiter.take("r", limit, 0)).allowed
        for _ in range(1000):  # a condition with a generous bound, not a fixed sleep
            if (await limiter.take("r", limit, 0)).allowed:
                break
            await asyncio.sleep(0.005)
        else:
            raise AssertionError("the bucket never refilled")
    finally:
        await client.aclose()


async def _ok(gw: Gateway, headers: dict[str, str], body: dict[str, Any] = COMP) -> Any:
    post = asyncio.create_task(gw.client.post("/v1/completions", json=body, headers=headers))
    req = await gw.engine.next_request()
    await gw.engine.generate(req, [" fine"])
    resp = await post
    assert resp.status == 200, await resp.text()
    await resp.read()
    return resp


async def _serve(gw: Gateway) -> None:
    while True:
        req = await gw.engine.next_request(timeout=60)
        await gw.engine.generate(req, [" fine"])


async def test_429_headers_and_body(redis_server: str, tiny_tokenizer_dir: Path, tmp_path: Path) -> None:
    path = _limits(tmp_path, {"default": {"requests_per_minute": 2, "tokens_per_minute": 10_000},
                              "keys": {"sk-big": {"requests_per_minute": 1000},
                                       "sk-small": {"tokens_per_minute": 20}}})
    async with open_live_gateway(redis_server, tiny_tokenizer_dir, rate_limits_path=str(path)) as gw:
        auth = {"Authorization": "Bearer sk-a"}
        first = await _ok(gw, auth)
        assert first.headers["x-ratelimit-limit-requests"] == "2"
        assert first.headers["x-ratelimit-remaining-requests"] == "1"
        assert first.headers["x-ratelimit-limit-tokens"] == "10000"
        assert int(first.headers["x-ratelimit-remaining-tokens"]) < 10_000 - 4
        assert first.headers["x-ratelimit-reset-requests"].endswith("s")
        second = await _ok(gw, auth, {**COMP, "stream": True})  # headers on a stream too
        assert second.headers["x-ratelimit-remaining-requests"] == "0"
        resp = await gw.client.post("/v1/completions", json=COMP, headers=auth)
        assert resp.status == 429
        assert 1 <= int(resp.headers["Retry-After"]) <= 60 and int(resp.headers["retry-after-ms"]) > 0
        assert resp.headers["x-ratelimit-remaining-requests"] == "0"
        error = (await resp.json())["error"]
        assert error["type"] == "requests" and error["code"] == "rate_limit_exceeded" and error["param"] is None
        assert "try again in" in error["message"]
        # other keys have their own buckets; the limits of an override
        assert (await _ok(gw, {"Authorization": "Bearer sk-b"})).headers["x-ratelimit-remaining-requests"] == "1"
        assert (await _ok(gw, {"Authorization": "Bearer sk-big"})).headers["x-ratelimit-limit-requests"] == "1000"
        small = await gw.client.post("/v1/completions", json={**COMP, "max_tokens": 30},
                                     headers={"Authorization": "Bearer sk-small"})
        assert small.status == 429 and "Retry-After" not in small.headers  # can never fit: 20 tokens a minute
        assert (await small.json())["error"]["type"] == "tokens"
        chat = await gw.client.post("/v1/chat/completions", headers=auth, json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert chat.status == 429
        metrics = await (await gw.client.get("/metrics")).text()
        assert 'pagedserve_gateway_rate_limited_total{type="requests"} 2.0' in metrics
        assert 'pagedserve_gateway_rate_limited_total{type="tokens"} 1.0' in metrics
        keys = [k.decode() if isinstance(k, bytes) else k for k in await gw.redis.keys("*ratelimit*")]
        assert keys and not any("sk-" in k for k in keys)
        assert any(key_hash("sk-a") in k for k in keys)


async def test_no_file_no_limits(redis_server: str, tiny_tokenizer_dir: Path) -> None:
    async with open_live_gateway(redis_server, tiny_tokenizer_dir) as gw:
        resp = await _ok(gw, {})
        assert not any(h.lower().startswith("x-ratelimit") for h in resp.headers)
        assert not await gw.redis.keys("*ratelimit*")


async def test_reload_on_change_and_sighup(redis_server: str, tiny_tokenizer_dir: Path, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ratelimit, "RELOAD_INTERVAL_S", 0.05)
    path = _limits(tmp_path, {"default": {"requests_per_minute": 1}})
    async with open_live_gateway(redis_server, tiny_tokenizer_dir, rate_limits_path=str(path)) as gw:
        file = gw.client.app[LIMITS_FILE]
        await _ok(gw, {})
        assert (await gw.client.post("/v1/completions", json=COMP)).status == 429  # no key: one shared bucket
        # a bad file keeps the old limits
        path.write_text("{broken")
        os.utime(path, ns=(1_000_000_000, 1_000_000_000))
        for _ in range(400):
            if file.rejected:
                break
            await asyncio.sleep(0.025)
        assert file.rejected == 1 and file.limits.default == Limit(1, None)
        assert (await gw.client.post("/v1/completions", json=COMP)).status == 429
        path.write_text(json.dumps({"window_seconds": 0.01, "default": {"requests_per_minute": 1}}))
        os.utime(path, ns=(2_000_000_000, 2_000_000_000))
        for _ in range(400):
            if file.reloads:
                break
            await asyncio.sleep(0.025)
        assert file.limits.window_s == 0.01, "the changed file was not reloaded"
        serving = asyncio.create_task(_serve(gw))  # admitted requests get answers, whenever they come
        try:
            for _ in range(400):  # the 10 ms window refills on Redis's clock
                resp = await gw.client.post("/v1/completions", json=COMP)
                if resp.status == 200:
                    break
                assert resp.status == 429
            else:
                raise AssertionError("never admitted after the refill")
        finally:
            serving.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await serving
        # SIGHUP re-reads the file (here unchanged in mtime but new in content)
        assert signal.getsignal(signal.SIGHUP) not in (signal.SIG_DFL, None), "no SIGHUP handler"
        stamp = os.stat(path).st_mtime_ns
        old_size = os.stat(path).st_size
        path.write_text(json.dumps({"default": {"requests_per_minute": 7}}).ljust(old_size))  # same size too
        os.utime(path, ns=(stamp, stamp))
        count = file.reloads
        os.kill(os.getpid(), signal.SIGHUP)
        for _ in range(400):
            if file.reloads > count:
                break
            await asyncio.sleep(0.025)
        assert file.limits.default == Limit(7, None)


def test_bad_file_refuses_start(tmp_path: Path) -> None:
    from gateway.app import create_app
    from gateway.config import GatewayConfig

    path = _limits(tmp_path, {"default": {"requests_per_minute": -3}})
    with pytest.raises(ValueError):
        create_app(GatewayConfig(rate_limits_path=str(path)))


async def test_bucket_times_keep_microseconds(redis_server: str, tmp_path: Path) -> None:
    """A Redis TIME-sized clock (16 digits of microseconds) is stored exactly."""
    limiter, client = await _limiter(redis_server, tmp_path)
    try:
        now = 1_764_812_345_678_901
        assert (await limiter.take("p", Limit(requests=5), 0, now)).allowed
        assert int(await client.hget(limiter.bucket_keys("p")[0], "t") or 0) == now
    finally:
        await client.aclose()
