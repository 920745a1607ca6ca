"""Engines and gateways on a real Redis Cluster (3 masters, 3 replicas, on loopback), with
`--redis-cluster`: two models (two engines for one, one for the other) behind two gateways.
`kill -9` of an engine under streaming load: its peer takes its requests over from the model's
slot. `kill -9` of the master that holds a model's request stream while streams of both models
run: its replica takes over. Either way every stream ends whole, each text equal to the
undisturbed run (no token lost or doubled), requests sent meanwhile are served, and serving goes on."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest
import redis
from redis.cluster import ClusterNode, RedisCluster

from common.protocol import EngineHeartbeat, Keys
from common.redis_spec import RedisSpec
from gateway.clients.sse_reader import sse_events
from tests.e2e.support import EngineProcess, serve_gateway
from tests.fixtures.redis_cluster import RedisClusterGroup

pytestmark = pytest.mark.slow
MODEL, OTHER = "tiny", "tiny-b"
KEYS = Keys()
STREAMS = 6
MAX_TOKENS = 160


def _cluster_client(group: RedisClusterGroup) -> RedisCluster:
    return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in group.addresses], socket_timeout=2)


class ClusterEngine(EngineProcess):
    """`pagedserve engine --redis-cluster ...`; its heartbeat read through a cluster client."""

    def __init__(self, model: Path, group: RedisClusterGroup, engine_id: str, log_dir: Path, name: str) -> None:
        self.group = group
        self.name = name
        super().__init__(model, "redis://127.0.0.1:1/0", engine_id, log_dir, "--redis-cluster", group.nodes_arg,
                         "--served-model-name", name, "--kv-cache-memory", "8MiB", "--redis-wait-timeout", "2000",
                         "--heartbeat-interval", "1.0")  # heartbeats outlive a failover (5 s)

    def heartbeat(self) -> EngineHeartbeat | None:
        try:
            with _cluster_client(self.group) as client:
                raw = client.hgetall(KEYS.engine(self.engine_id))
        except (redis.RedisError, OSError):
            return None
        return EngineHeartbeat.from_hash(raw) if raw else None

    def pending(self) -> int:
        """Entries of its model's shared and own routed stream it holds un-acked."""
        held = 0
        with _cluster_client(self.group) as client:
            for stream in (KEYS.requests(self.name), KEYS.routed(self.name, self.engine_id)):
                if client.exists(stream):
                    held += sum(int(c["pending"]) for c in client.xpending(stream, KEYS.group)["consumers"]
                                if c["name"].decode() == self.engine_id)
        return held


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[
        tuple[RedisClusterGroup, list[ClusterEngine]]]:
    group = RedisClusterGroup(masters=3, replicas=1, node_timeout_ms=1000)
    engines: list[ClusterEngine] = []
    try:
        log_dir = tmp_path_factory.mktemp("e2e-redis-cluster")
        engines = [ClusterEngine(tiny_llama_dir, group, engine_id, log_dir, name)
                   for engine_id, name in (("rc-a0", MODEL), ("rc-a1", MODEL), ("rc-b0", OTHER))]
        for engine in engines:
            engine.wait_ready(timeout=600)  # three engines loading at once on a busy machine
        yield group, engines
    finally:
        for engine in engines:
            engine.stop()
        group.stop()


@contextlib.asynccontextmanager
async def _gateways(group: RedisClusterGroup) -> AsyncIterator[list[str]]:
    spec = RedisSpec(cluster=group.addresses, wait_timeout_ms=2000)
    async with serve_gateway("redis://127.0.0.1:1/0", redis=spec) as a, \
            serve_gateway("redis://127.0.0.1:1/0", redis=spec) as b:
        yield [a, b]


async def _retrying(session: aiohttp.ClientSession, url: str, model: str, prompt: str,
                    max_tokens: int) -> tuple[str, str | None, int]:
    """`_stream`, sent again after a 503 before any token (Redis unreachable for a moment: a
    balancer or a client retries), for up to a minute."""
    deadline = time.monotonic() + 60
    while True:
        try:
            return await _stream(session, url, model, prompt, max_tokens)
        except Unavailable:
            assert time.monotonic() < deadline, "still refused a minute after the failover began"
            await asyncio.sleep(0.2)


class Unavailable(AssertionError):
    """A 503 before the stream began."""


async def _stream(session: aiohttp.ClientSession, url: str, model: str, prompt: str, max_tokens: int,
                  seen: list[int] | None = None) -> tuple[str, str | None, int]:
    """A greedy streamed completion: (text, finish_reason, completion_tokens); `seen[0]` counts
    the chunks received so far."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    text, finish, tokens = "", None, 0
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        if resp.status == 503:
            raise Unavailable(await resp.text())
        assert resp.status == 200, await resp.text()
        async for event in sse_events(resp):
            assert "error" not in event, event
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            for choice in event["choices"]:
                text += choice["text"]
                finish = choice["finish_reason"] or finish
                if seen is not None:
                    seen[0] += 1
    return text, finish, tokens


async def _until(condition: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def _models_listed(session: aiohttp.ClientSession, url: str) -> None:
    deadline = time.monotonic() + 60
    while True:
        async with session.get(f"{url}/v1/models") as resp:
            if resp.status == 200 and {MODEL, OTHER} <= {m["id"] for m in (await resp.json())["data"]}:
                return
        assert time.monotonic() < deadline, "the gateway never listed the engine's model"
        await asyncio.sleep(0.1)


Job = tuple[str, str, str]  # gateway URL, model, prompt


async def _run(session: aiohttp.ClientSession, jobs: list[Job]) -> list[tuple[str, str | None, int]]:
    return list(await asyncio.gather(*(_stream(session, url, model, prompt, MAX_TOKENS)
                                       for url, model, prompt in jobs)))


def _check(results: list[tuple[str, str | None, int]], expected: list[tuple[str, str | None, int]]) -> None:
    for (text, finish, tokens), (want, _, _) in zip(results, expected, strict=True):
        assert (finish, tokens) == ("length", MAX_TOKENS)
        assert text == want  # whole: nothing lost, nothing doubled


async def test_kill_9_engine_its_peer_takes_over(cluster: tuple[RedisClusterGroup, list[ClusterEngine]]) -> None:
    group, engines = cluster
    async with _gateways(group) as urls, aiohttp.ClientSession() as session:
        for url in urls:
            await _models_listed(session, url)
        jobs = [(urls[i % 2], MODEL, f"engine kill {i}:") for i in range(STREAMS)]
        expected = await _run(session, jobs)
        seen = [[0] for _ in jobs]
        running = [asyncio.create_task(_stream(session, url, model, prompt, MAX_TOKENS, s))
                   for (url, model, prompt), s in zip(jobs, seen, strict=True)]
        await _until(lambda: all(s[0] >= 5 for s in seen), 120, "every stream to be under way")
        victim = max(engines[:2], key=lambda e: e.pending())
        assert victim.pending() > 0, "no engine of the model holds a request"
        victim.kill()
        at_kill = [s[0] for s in seen]
        results = await asyncio.wait_for(asyncio.gather(*running), 300)
        assert any(n < MAX_TOKENS for n in at_kill), f"every stream had ended before the kill: {at_kill}"
        _check(results, expected)
        _check(await _run(session, jobs[:2]), expected[:2])  # serving goes on


async def test_streams_survive_the_loss_of_the_models_master(
        cluster: tuple[RedisClusterGroup, list[ClusterEngine]]) -> None:
    group, engines = cluster
    async with _gateways(group) as urls, aiohttp.ClientSession() as session:
        for url in urls:
            await _models_listed(session, url)
        jobs = [(urls[i % 2], (MODEL, OTHER)[(i // 2) % 2], f"cluster request {i}:") for i in range(STREAMS)]
        expected = await _run(session, jobs)
        seen = [[0] for _ in jobs]
        running = [asyncio.create_task(_stream(session, url, model, prompt, MAX_TOKENS, s))
                   for (url, model, prompt), s in zip(jobs, seen, strict=True)]
        await _until(lambda: all(s[0] >= 5 for s in seen), 120, "every stream to be under way")
        victim = group.master_of(KEYS.requests(MODEL))
        group.kill(victim)
        at_kill = [s[0] for s in seen]
        # sent while the model's master is down or just replaced: served (after a 503 at most)
        late = [asyncio.create_task(_retrying(session, url, model, prompt, MAX_TOKENS)) for url, model, prompt in jobs]
        new_master = group.wait_failover(victim, KEYS.requests(MODEL))
        results = await asyncio.wait_for(asyncio.gather(*running, *late), 300)
        assert any(n < MAX_TOKENS for n in at_kill), f"every stream had ended before the kill: {at_kill}"
        assert new_master != victim
        _check(results, [*expected, *expected])
        _check(await _run(session, jobs[:2]), expected[:2])  # serving goes on
    for engine in engines:
        assert engine.proc.poll() in (None, -signal.SIGKILL), engine.log_tail()  # none died but the one killed
