"""Fault-injection support: a real cluster (redis-server with an AOF, two engine processes,
two gateway processes), a load of greedy streaming requests, and the verdict on each request
against an undisturbed run of the same prompts.

Verdicts, per request:
- ``identical``: it finished ([DONE], no error) with exactly the reference text and length;
- ``clean_error``: it ended with an OpenAI error (HTTP status or an SSE error event), or its
  connection dropped because its own gateway was killed, and the text it got before is a
  prefix of the reference (nothing wrong or doubled was shown);
- ``lost``: it finished without error but short of the reference (tokens missing), or never ended;
- ``duplicated``: the text it showed is not a prefix of the reference (repeated or wrong tokens).
"""

from __future__ import annotations

import asyncio
import errno
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import redis

from common.protocol import Keys
from gateway.clients.sse_reader import SSE_DONE, sse_payloads
from pagedserve.launch.redis_server import RedisServer
from tests.e2e.support import EngineProcess, GatewayProcess

MODEL = "tiny"
KEYS = Keys()
ENGINE_ARGS = ("--served-model-name", MODEL, "--kv-cache-memory", "16MiB", "--drain-timeout", "0")


@dataclass
class Outcome:
    """What one client saw."""

    text: str = ""
    done: bool = False
    error: str | None = None
    dropped: bool = False  # the connection broke without an error event
    tokens: int = 0
    refused: bool = False  # the connect itself was refused: no gateway got the request


@dataclass
class Tally:
    fault: str
    requests: int = 0
    identical: int = 0
    clean_errors: int = 0
    lost: int = 0
    duplicated: int = 0
    notes: list[str] = field(default_factory=list)

    def row(self) -> str:
        return (f"| {self.fault} | {self.requests} | {self.identical} | {self.clean_errors} | {self.lost} | "
                f"{self.duplicated} |")


def prompt(i: int) -> str:
    return f"Request {i} tells the story of"


async def stream_one(session: aiohttp.ClientSession, url: str, text: str, max_tokens: int,
                     started: asyncio.Event | None = None) -> Outcome:
    """A greedy streaming completion; never raises for what a fault can cause."""
    body = {"model": MODEL, "prompt": text, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    out = Outcome()
    try:
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return out
            async for event in sse_payloads(resp.content):
                if event == SSE_DONE:
                    out.done = True
                else:
                    if "error" in event:
                        out.error = str(event["error"].get("code") or event["error"].get("message"))
                        continue
                    if event.get("usage"):
                        out.tokens = event["usage"]["completion_tokens"]
                    for choice in event["choices"]:
                        out.text += choice["text"]
                    if started is not None and out.text:
                        started.set()
    except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as exc:
        out.dropped, out.error = True, f"connection: {type(exc).__name__}"
        out.refused = isinstance(exc, aiohttp.ClientConnectorError) and exc.os_error.errno == errno.ECONNREFUSED
    if started is not None:
        started.set()
    return out


def judge(fault: str, outcomes: list[Outcome], reference: list[str], max_tokens: int,
          droppable: set[int] = frozenset()) -> Tally:  # type: ignore[assignment]
    """Classify every outcome against the undisturbed texts; `droppable` are the indexes whose
    gateway was killed (a dropped connection is their clean error)."""
    tally = Tally(fault, len(outcomes))
    for i, (out, ref) in enumerate(zip(outcomes, reference, strict=True)):
        if not ref.startswith(out.text):
            tally.duplicated += 1
            tally.notes.append(f"{i}: showed {out.text[-40:]!r}, reference {ref[:len(out.text)][-40:]!r}")
        elif out.done and out.error is None and out.text == ref and out.tokens == max_tokens:
            tally.identical += 1
        elif out.error is not None and (not out.dropped or i in droppable):
            tally.clean_errors += 1
        else:
            tally.lost += 1
            tally.notes.append(f"{i}: done={out.done} error={out.error} got {len(out.text)}/{len(ref)} chars")
    return tally


class Cluster:
    """Redis (AOF, fsync always) + 2 engines + 2 gateways, all real processes."""

    def __init__(self, model: Path, log_dir: Path) -> None:
        self.model = model
        self.log_dir = log_dir
        self.redis = RedisServer(appendonly=True).start()
        self.engines: list[EngineProcess] = []
        self.gateways: list[GatewayProcess] = []
        self._names = 0

    def _name(self, kind: str) -> str:
        self._names += 1
        return f"{kind}-{self._names}"

    def add_engines(self, count: int) -> None:
        new = [EngineProcess(self.model, self.redis.url, self._name("eng"), self.log_dir, *ENGINE_ARGS)
               for _ in range(count)]
        for engine in new:
            engine.wait_ready()
        self.engines += new

    def add_gateways(self, count: int) -> None:
        new = [GatewayProcess(self.redis.url, self._name("gw"), self.log_dir) for _ in range(count)]
        for gateway in new:
            gateway.wait_healthy()
        self.gateways += new

    @property
    def urls(self) -> list[str]:
        return [g.url for g in self.gateways]

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.redis.url)

    def wait_healthy(self) -> None:
        for gateway in self.gateways:
            gateway.wait_healthy()

    def check_clean(self) -> dict[str, int]:
        """Zero blocks held, nothing running, request streams (shared and routed) empty, no checkpoint left, output
        streams bounded. Returns the figures."""
        for engine in self.engines:
            stats = engine.wait_drained(60)
            assert stats["num_used_blocks"] == 0, (engine.engine_id, stats)
        with self.client() as client:
            routed = [m.decode() for m in client.smembers(KEYS.routed_streams(MODEL))]
            figures = {"xlen_requests": int(client.xlen(KEYS.requests(MODEL))),
                       "xlen_routed": sum(int(client.xlen(stream)) for stream in routed),
                       "progress_keys": len(list(client.scan_iter(match=KEYS.progress_pattern))),
                       "xlen_out_max": max((int(client.xlen(KEYS.out(g.gateway_id))) for g in self.gateways),
                                           default=0)}
        assert figures["xlen_requests"] == 0 and figures["xlen_routed"] == 0 and figures["progress_keys"] == 0, figures
        assert figures["xlen_out_max"] <= 10_100, figures
        return figures

    def stop(self) -> None:
        for proc in [*self.gateways, *self.engines]:
            proc.stop()
        self.redis.stop()


async def run_with_fault(cluster: Cluster, count: int, max_tokens: int,
                         fault: Callable[[], Awaitable[None]]) -> list[Outcome]:
    """Start `count` streams over both gateways; once every one has shown text, inject the
    fault; return what each client saw."""
    timeout = aiohttp.ClientTimeout(total=300, sock_read=120)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        started = [asyncio.Event() for _ in range(count)]
        tasks = [asyncio.create_task(stream_one(session, cluster.urls[i % 2], prompt(i), max_tokens, started[i]))
                 for i in range(count)]
        await asyncio.wait_for(asyncio.gather(*(s.wait() for s in started)), 240)
        await fault()
        return list(await asyncio.gather(*tasks))


async def reference_texts(cluster: Cluster, count: int, max_tokens: int) -> list[str]:
    async def nothing() -> None:
        return None

    outcomes = await run_with_fault(cluster, count, max_tokens, nothing)
    assert all(o.done and o.error is None and o.tokens == max_tokens for o in outcomes), outcomes[:3]
    return [o.text for o in outcomes]


def sleep_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.1)
