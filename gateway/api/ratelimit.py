"""Per-API-key rate limits shared by every gateway: two token buckets per key in Redis (requests,
tokens), both taken or neither by one Lua script on Redis's clock (TIME), so gateways with
skewed clocks enforce one budget.

A bucket holds up to its limit and refills at limit / window. A request costs 1 request and
prompt tokens + n * max_tokens tokens, reserved at admission and never refunded (the engine may
stop earlier; a client that wants more requests in should ask for fewer max_tokens). Keys in
Redis are `<prefix>:ratelimit:{<sha256 of the API key>}:requests|tokens`, never the key."""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass

import redis.asyncio as aioredis
from aiohttp import web
from redis.exceptions import RedisError

from gateway.errors import OpenAIError
from gateway.metrics import GatewayMetrics
from gateway.ratelimit_config import Limit, LimitsFile
from gateway.state import BROKER, METRICS

# KEYS: requests bucket, tokens bucket. ARGV: request limit, token limit (0 = none), window (us),
# token cost, now (us; "" = Redis TIME, a test may pass its own clock). Each bucket is a hash
# {l: level, t: time (us) of that level}; a missing bucket is full.
# Returns {allowed, kind ("" / "requests" / "tokens"), wait (us, -1 = never), request remaining,
# request reset (us until full), token remaining, token reset}.
_LUA = """
local now = tonumber(ARGV[5])
if now == nil then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
end
local window = tonumber(ARGV[3])
local caps = {tonumber(ARGV[1]), tonumber(ARGV[2])}
local costs = {1, tonumber(ARGV[4])}
local levels = {0, 0}
local kind, wait = '', 0
for i = 1, 2 do
  local cap = caps[i]
  if cap > 0 then
    local v = redis.call('HMGET', KEYS[i], 'l', 't')
    local l, t = tonumber(v[1]), tonumber(v[2])
    if l == nil or t == nil then
      l = cap
    elseif now > t then
      l = math.min(cap, l + (now - t) * cap / window)
    end
    levels[i] = l
    local need
    if costs[i] > cap then need = -1 elseif l < costs[i] then need = (costs[i] - l) * window / cap else need = 0 end
    if need < 0 then
      kind, wait = (i == 1 and 'requests' or 'tokens'), -1
    elseif need > 0 and wait >= 0 and need > wait then
      kind, wait = (i == 1 and 'requests' or 'tokens'), need
    end
  end
end
local out = {0, kind, math.ceil(wait), 0, 0, 0, 0}
if kind == '' then out[1] = 1 end
for i = 1, 2 do
  local cap = caps[i]
  if cap > 0 then
    local l = levels[i]
    if kind == '' then
      l = l - costs[i]
      redis.call('HSET', KEYS[i], 'l', string.format('%.17g', l), 't', string.format('%.17g', now))
      redis.call('PEXPIRE', KEYS[i], math.ceil(window / 1000) + 1000)
    end
    out[2 + 2 * i] = math.floor(math.max(l, 0))
    out[3 + 2 * i] = math.ceil((cap - l) * window / cap)
  end
end
return out
"""


@dataclass(frozen=True, slots=True)
class Verdict:
    """What the script said, in seconds."""

    allowed: bool
    kind: str  # "requests" / "tokens" when refused
    wait_s: float  # until the refused bucket holds enough; inf: it never will (cost above the limit)
    remaining: tuple[int, int]  # requests, tokens
    reset_s: tuple[float, float]  # until each bucket is full again


def _duration(seconds: float) -> str:
    """OpenAI's reset format: "20ms", "1.5s", "6m0s"."""
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    if seconds < 60:
        return f"{round(seconds, 3):g}s"
    minutes, rest = divmod(seconds, 60)
    return f"{int(minutes)}m{round(rest):d}s"


def _headers(limit: Limit, verdict: Verdict) -> dict[str, str]:
    headers: dict[str, str] = {}
    for i, (name, value) in enumerate((("requests", limit.requests), ("tokens", limit.tokens))):
        if value is not None:
            headers[f"x-ratelimit-limit-{name}"] = str(value)
            headers[f"x-ratelimit-remaining-{name}"] = str(verdict.remaining[i])
            headers[f"x-ratelimit-reset-{name}"] = _duration(verdict.reset_s[i])
    return headers


class RateLimiter:
    """Admits requests against the limits of `file`, buckets in `client` under `prefix`."""

    def __init__(self, client: aioredis.Redis, prefix: str, file: LimitsFile, metrics: GatewayMetrics) -> None:
        self.client = client
        self.prefix = prefix
        self.file = file
        self.metrics = metrics
        self._script = client.register_script(_LUA)

    def bucket_keys(self, bucket: str) -> tuple[str, str]:
        """Redis keys of one bucket id (a key hash or "anonymous"); one hash slot for both."""
        base = f"{self.prefix}:ratelimit:{{{bucket}}}"
        return f"{base}:requests", f"{base}:tokens"

    async def take(self, bucket: str, limit: Limit, tokens: int, now_us: int | None = None) -> Verdict:
        """Run the script: take 1 request and `tokens` from `bucket` if both are there."""
        window_us = max(1, round(self.file.limits.window_s * 1_000_000))
        raw = await self._script(keys=list(self.bucket_keys(bucket)),
                                 args=[limit.requests or 0, limit.tokens or 0, window_us, tokens,
                                       "" if now_us is None else now_us])
        allowed, kind, wait, req_left, req_reset, tok_left, tok_reset = raw
        kind = kind.decode() if isinstance(kind, bytes) else str(kind)
        return Verdict(bool(allowed), kind, math.inf if int(wait) < 0 else int(wait) / 1e6,
                       (int(req_left), int(tok_left)), (int(req_reset) / 1e6, int(tok_reset) / 1e6))

    async def admit(self, api_key: str | None, tokens: int) -> dict[str, str]:
        """The x-ratelimit-* headers of an admitted request; raises OpenAIError 429 (with
        Retry-After) over budget, 503 when Redis cannot be reached."""
        limits = self.file.limits
        bucket, limit = limits.for_key(api_key)
        if limit.unlimited:
            return {}
        try:
            verdict = await self.take(bucket, limit, tokens)
        except RedisError as exc:
            raise OpenAIError(503, f"cannot reach Redis: {exc}", code="redis_unavailable") from exc
        headers = _headers(limit, verdict)
        if verdict.allowed:
            return headers
        self.metrics.rate_limited.labels(type=verdict.kind).inc()
        per = f"{'requests' if verdict.kind == 'requests' else 'tokens'} per {limits.window_s:g}s"
        value = limit.requests if verdict.kind == "requests" else limit.tokens
        if math.isinf(verdict.wait_s):
            raise OpenAIError(429, f"Request too large for {per}: Limit {value}, Requested {tokens}. "
                              "Send fewer prompt tokens or a smaller max_tokens.", None,
                              "rate_limit_exceeded", "tokens", headers)
        wait = max(verdict.wait_s, 0.001)
        headers |= {"Retry-After": str(max(1, math.ceil(wait))), "retry-after-ms": str(math.ceil(wait * 1000))}
        requested = 1 if verdict.kind == "requests" else tokens
        raise OpenAIError(429, f"Rate limit reached on {per}: Limit {value}, Requested {requested}. "
                          f"Please try again in {_duration(wait)}.", None, "rate_limit_exceeded",
                          verdict.kind, headers)


RATE_LIMITER = web.AppKey("rate_limiter", RateLimiter)
RELOAD_INTERVAL_S = 2.0  # how often the limits file's mtime is checked
_HEADERS = "pagedserve_ratelimit_headers"


def bearer_token(request: web.Request) -> str | None:
    """The request's Bearer token, None without one."""
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    return (token.strip() or None) if scheme.lower() == "bearer" else None


async def admit(request: web.Request, tokens: int) -> None:
    """Charge the request to its API key when rate limits are configured (else nothing); the
    x-ratelimit-* headers go on its response (`add_headers`)."""
    limiter = request.app.get(RATE_LIMITER)
    if limiter is not None:
        request[_HEADERS] = await limiter.admit(bearer_token(request), tokens)


async def add_headers(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: the admitted request's x-ratelimit-* headers, streams included."""
    headers = request.get(_HEADERS)
    if headers:
        response.headers.update(headers)


LIMITS_FILE = web.AppKey("rate_limits_file", LimitsFile)


def install(app: web.Application, path: str) -> None:
    """Rate limits from `path` for `app` (raises RateLimitConfigError on a bad file): loaded now,
    enforced once Redis is up (after the app's Redis context), reloaded while it runs."""
    app[LIMITS_FILE] = LimitsFile(path)
    app.on_response_prepare.append(add_headers)
    app.cleanup_ctx.append(_ctx)


async def _ctx(app: web.Application) -> AsyncIterator[None]:
    file = app[LIMITS_FILE]
    app[RATE_LIMITER] = RateLimiter(app[BROKER].client, app[BROKER].keys.prefix, file, app[METRICS])
    task = asyncio.create_task(file.watch(RELOAD_INTERVAL_S), name="rate-limits-watch")
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task

