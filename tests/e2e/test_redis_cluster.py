"""An engine and a gateway on a real Redis Cluster (3 masters, 3 replicas, on loopback), with
`--redis-cluster`: greedy streams come through whole; then `kill -9` of the master that holds the
model's request stream while streams are running: its replica takes over, and every stream ends
whole, each text equal to the undisturbed run (no token lost or doubled), requests sent during
the failover are served, and serving goes on."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
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
MODEL = "tiny"
KEYS = Keys()
STREAMS = 6
MAX_TOKENS = 160


class ClusterEngine(EngineProcess):
    """`pagedserve engine --redis-cluster ...`; its heartbeat read through a cluster client."""

    def __init__(self, model: Path, group: RedisClusterGroup, engine_id: str, log_dir: Path) -> None:
        self.group = group
        super().__init__(model, "redis://127.0.0.1:1/0", engine_id, log_dir, "--redis-cluster", group.nodes_arg,
                         "--served-model-name", MODEL, "--kv-cache-memory", "8MiB", "--redis-wait-timeout", "2000")

    def heartbeat(self) -> EngineHeartbeat | None:
        try:
            with RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in self.group.addresses],
                              socket_timeout=2) as client:
                raw = client.hgetall(KEYS.engine(self.engine_id))
        except (redis.RedisError, OSError):
            return None
        return EngineHeartbeat.from_hash(raw) if raw else None


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[
        tuple[RedisClusterGroup, ClusterEngine]]:
    group = RedisClusterGroup(masters=3, replicas=1, node_timeout_ms=1000)
    engine = None
    try:
        engine = ClusterEngine(tiny_llama_dir, group, "rc-0", tmp_path_factory.mktemp("e2e-redis-cluster"))
        engine.wait_ready()
        yield group, engine
    finally:
        if engine is not None:
            engine.stop()
        group.stop()


async def _stream(session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int,
                  seen: list[int] | None = None) -> tuple[str, str | None, int]:
    """A greedy streamed completion: (text, finish_reason, completion_tokens); `seen[0]` counts
    the chunks received so far."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    text, finish, tokens = "", None, 0
    async with session.post(f"{url}/v1/completions", json=body) as resp:
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


async def _model_listed(session: aiohttp.ClientSession, url: str) -> None:
    deadline = time.monotonic() + 60
    while True:
        async with session.get(f"{url}/v1/models") as resp:
            if resp.status == 200 and MODEL in {m["id"] for m in (await resp.json())["data"]}:
                return
        assert time.monotonic() < deadline, "the gateway never listed the engine's model"
        await asyncio.sleep(0.1)


async def test_streams_survive_the_loss_of_the_models_master(
        cluster: tuple[RedisClusterGroup, ClusterEngine]) -> None:
    group, engine = cluster
    spec = RedisSpec(cluster=group.addresses, wait_timeout_ms=2000)
    prompts = [f"cluster request {i}:" for i in range(STREAMS)]
    async with serve_gateway("redis://127.0.0.1:1/0", redis=spec) as url, aiohttp.ClientSession() as session:
        await _model_listed(session, url)
        expected = await asyncio.gather(*(_stream(session, url, p, MAX_TOKENS) for p in prompts))
        assert all(finish == "length" and tokens == MAX_TOKENS for _, finish, tokens in expected)

        seen = [[0] for _ in prompts]
        running = [asyncio.create_task(_stream(session, url, p, MAX_TOKENS, s)) for p, s in zip(prompts, seen,
                                                                                               strict=True)]
        await _until(lambda: all(s[0] >= 5 for s in seen), 120, "every stream to be under way")
        victim = group.master_of(KEYS.requests(MODEL))
        group.kill(victim)
        at_kill = [s[0] for s in seen]
        # submitted while the model's master is down or just replaced: they wait for the new one
        late = [asyncio.create_task(_stream(session, url, p, MAX_TOKENS)) for p in prompts[:2]]
        new_master = group.wait_failover(victim, KEYS.requests(MODEL))
        results = await asyncio.wait_for(asyncio.gather(*running, *late), 300)
        assert any(n < MAX_TOKENS for n in at_kill), f"every stream had ended before the kill: {at_kill}"
        assert new_master != victim
        for (text, finish, tokens), (want, _, _) in zip(results, [*expected, *expected[:2]], strict=True):
            assert (finish, tokens) == ("length", MAX_TOKENS)
            assert text == want  # whole: nothing lost, nothing doubled

        after = await asyncio.gather(*(_stream(session, url, p, MAX_TOKENS) for p in prompts[:2]))
        assert [text for text, _, _ in after] == [text for text, _, _ in expected[:2]]  # serving goes on
    assert engine.proc.poll() is None, engine.log_tail()
