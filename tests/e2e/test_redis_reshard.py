"""Resharding a real Redis Cluster (3 masters, 3 replicas) under streaming load loses nothing.
Two models (an engine each) behind two gateways stream greedy completions while one slot moves
to another master the way `redis-cli --cluster reshard` moves it, held at each step while
requests run: MIGRATING/IMPORTING with every key still on the source, then every key on the
target but the slot not yet handed over (the source answers ASK: scripts, transactions and
reads follow it), then handed over (MOVED). The slot is (a) a model's, with its request stream,
(b) a gateway's, with its output stream and its requests' checkpoints.

Every request's outcome is counted: each stream ends whole, its text equal to the undisturbed
run (no token lost or doubled), whether it was sent before, during or after the move; streams
go on while the slot is held; the engines end with no KV block in use; no engine or gateway
logs an error."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from structlog.testing import capture_logs

from common.protocol import Keys
from common.redis_spec import RedisSpec
from gateway.clients.sse_reader import sse_events
from tests.e2e.support import serve_gateway
from tests.e2e.test_redis_cluster import MODEL, OTHER, ClusterEngine, _models_listed, _until
from tests.fixtures.redis_cluster import RedisClusterGroup
from tests.fixtures.redis_reshard import SlotMigration, slot_master

pytestmark = pytest.mark.slow
KEYS = Keys()
STREAMS = 6
MAX_TOKENS = 320
UNDER_WAY = 5  # chunks a stream has before the slot starts moving
ADVANCE = 3  # chunks every running stream gets while the slot is held in a step
WAIT_S = 180.0  # bound on each wait for a condition (a hang guard, not a duration under test)

Job = tuple[str, str, str]  # gateway URL, model, prompt
Cluster = tuple[RedisClusterGroup, list[ClusterEngine]]


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    group = RedisClusterGroup(masters=3, replicas=1, node_timeout_ms=1000)
    engines: list[ClusterEngine] = []
    try:
        log_dir = tmp_path_factory.mktemp("e2e-redis-reshard")
        engines = [ClusterEngine(tiny_llama_dir, group, engine_id, log_dir, name)
                   for engine_id, name in (("rs-a", MODEL), ("rs-b", OTHER))]
        for engine in engines:
            engine.wait_ready(timeout=600)
        yield group, engines
    finally:
        for engine in engines:
            engine.stop()
        group.stop()


@contextlib.asynccontextmanager
async def _gateways(group: RedisClusterGroup, ids: tuple[str, str]) -> AsyncIterator[list[str]]:
    spec = RedisSpec(cluster=group.addresses, wait_timeout_ms=2000)
    async with serve_gateway("redis://127.0.0.1:1/0", redis=spec, gateway_id=ids[0]) as a, \
            serve_gateway("redis://127.0.0.1:1/0", redis=spec, gateway_id=ids[1]) as b:
        yield [a, b]


async def _completion(session: aiohttp.ClientSession, url: str, model: str, prompt: str,
                      seen: list[int]) -> tuple[str, str | None, int]:
    """A greedy streamed completion: (text, finish_reason, completion_tokens); `seen[0]` counts
    its chunks so far. Raises AssertionError on a refusal or an error event."""
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    text, finish, tokens = "", None, 0
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        assert resp.status == 200, f"HTTP {resp.status}: {await resp.text()}"
        async for event in sse_events(resp):
            assert "error" not in event, event
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            for choice in event["choices"]:
                text += choice["text"]
                finish = choice["finish_reason"] or finish
                seen[0] += 1
    return text, finish, tokens


class Load:
    """Streams in flight, each checked against the undisturbed run of its prompt; `outcomes`
    counts how each ended ("whole" or what went wrong)."""

    def __init__(self, session: aiohttp.ClientSession, expected: dict[tuple[str, str], str]) -> None:
        self.session = session
        self.expected = expected
        self.outcomes: Counter[str] = Counter()
        self.tasks: list[asyncio.Task[None]] = []

    def send(self, jobs: list[Job]) -> list[tuple[list[int], asyncio.Task[None]]]:
        """Start one stream per job; each one's chunk counter and task."""
        started = []
        for url, model, prompt in jobs:
            seen = [0]
            task = asyncio.create_task(self._one(url, model, prompt, seen))
            self.tasks.append(task)
            started.append((seen, task))
        return started

    async def _one(self, url: str, model: str, prompt: str, seen: list[int]) -> None:
        try:
            text, finish, tokens = await _completion(self.session, url, model, prompt, seen)
        except AssertionError as exc:
            outcome = f"failed: {str(exc)[:160]}"
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            outcome = f"broken: {type(exc).__name__}"
        else:
            if (finish, tokens) != ("length", MAX_TOKENS):
                outcome = f"cut short: {finish} after {tokens} tokens"
            elif text != self.expected[(model, prompt)]:
                outcome = "text differs from the undisturbed run"
            else:
                outcome = "whole"
        self.outcomes[outcome] += 1

    @staticmethod
    async def advance(streams: list[tuple[list[int], asyncio.Task[None]]], by: int, what: str) -> None:
        """Until every stream still running got `by` more chunks than it has now (or ended after
        one more); some must be running, or there is nothing to see."""
        live = [(seen, task) for seen, task in streams if not task.done()]
        assert live, f"every stream had ended before: {what}"
        base = [seen[0] for seen, _ in live]
        await _until(lambda: all(seen[0] >= b + by or (task.done() and seen[0] > b)
                                 for (seen, task), b in zip(live, base, strict=True)), WAIT_S, what)

    async def settle(self) -> Counter[str]:
        await asyncio.wait_for(asyncio.gather(*self.tasks), 600)
        return self.outcomes


async def _expected(session: aiohttp.ClientSession, jobs: list[Job]) -> dict[tuple[str, str], str]:
    """The undisturbed greedy text of each job's (model, prompt)."""
    async def one(url: str, model: str, prompt: str) -> tuple[tuple[str, str], str]:
        text, finish, tokens = await _completion(session, url, model, prompt, [0])
        assert (finish, tokens) == ("length", MAX_TOKENS)
        return (model, prompt), text
    return dict(await asyncio.gather(*(one(*job) for job in jobs)))


def _jobs(urls: list[str], tag: str) -> list[Job]:
    return [(urls[i % 2], (MODEL, OTHER)[(i // 2) % 2], f"reshard {tag} {i}:") for i in range(STREAMS)]


def _errors(logs: list[dict[str, Any]], caplog: pytest.LogCaptureFixture) -> list[Any]:
    """Error events the in-process gateways logged (structlog), and errors of the standard
    logging (aiohttp's unhandled request errors, asyncio's unretrieved task exceptions)."""
    return [*(entry for entry in logs if entry.get("log_level") in ("error", "critical", "exception")),
            *(record.getMessage() for record in caplog.records if record.levelno >= logging.ERROR)]


def _check_engines(engines: list[ClusterEngine]) -> None:
    """Alive, holding no KV block and running nothing, and no error or traceback in the log."""
    for engine in engines:
        assert engine.proc.poll() is None, engine.log_tail()
        engine.wait_drained(timeout=WAIT_S)
        log = engine.log_path.read_text(errors="replace")
        assert "Traceback" not in log and "[error" not in log, engine.log_tail(6000)


def _pending(engines: list[ClusterEngine]) -> int:
    return sum(engine.pending() for engine in engines)


async def test_moving_a_models_request_stream_slot_loses_nothing(cluster: Cluster,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    group, engines = cluster
    with capture_logs() as logs:
        async with _gateways(group, ("rs-m-gw-a", "rs-m-gw-b")) as urls, aiohttp.ClientSession() as session:
            for url in urls:
                await _models_listed(session, url)
            jobs = _jobs(urls, "model")
            load = Load(session, await _expected(session, jobs))
            running = load.send(jobs)
            await load.advance(running, UNDER_WAY, "every stream to be under way")

            migration = SlotMigration.of_key(group, KEYS.requests(MODEL)).start()
            late = load.send(jobs)  # submitted while the slot is MIGRATING, every key still on the source
            await load.advance(running + late, ADVANCE, "streams to go on while the slot is migrating")
            keys = len(migration.keys_left())
            assert keys >= 3, migration.keys_left()  # request stream, its routed streams, epoch, liveness keys
            assert migration.move(keys // 2) > 0  # keys split between two masters: TRYAGAIN for a while
            migration.move()
            assert migration.keys_left() == [] and len(migration.keys_moved()) >= keys
            asked = load.send(jobs)  # every key on the target, the slot not handed over: ASK
            await load.advance(running + late + asked, ADVANCE, "streams to go on through ASK redirects")

            migration.finish()
            assert slot_master(group, migration.slot) == migration.target
            after = load.send(jobs[:2])  # the slot's new master answers; the old one says MOVED
            outcomes = await load.settle()
            assert outcomes == Counter({"whole": len(running) + len(late) + len(asked) + len(after)}), outcomes
    assert not _errors(logs, caplog), _errors(logs, caplog)
    _check_engines(engines)


async def test_moving_a_gateways_output_slot_loses_nothing(cluster: Cluster,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    group, engines = cluster
    moved_gateway = "rs-g-gw-a"
    with capture_logs() as logs:
        async with _gateways(group, (moved_gateway, "rs-g-gw-b")) as urls, aiohttp.ClientSession() as session:
            for url in urls:
                await _models_listed(session, url)
            jobs = _jobs(urls, "gateway")
            load = Load(session, await _expected(session, jobs))
            running = load.send(jobs)
            await load.advance(running, UNDER_WAY, "every stream to be under way")

            migration = SlotMigration.of_key(group, KEYS.out(moved_gateway)).start()
            await load.advance(running, ADVANCE, "streams to go on while the gateway's slot is migrating")
            keys = len(migration.keys_left())
            assert keys >= 3, migration.keys_left()  # output stream, liveness key, checkpoints
            assert migration.move(keys // 2) > 0
            migration.move()
            assert migration.keys_left() == []
            await load.advance(running, ADVANCE, "streams to go on through ASK redirects")

            # new requests while the slot is still held: their first checkpoint is a new key in an
            # importing slot, which Redis refuses in a transaction (TRYAGAIN) until the slot is handed over
            late = load.send(jobs)
            await _until(lambda: _pending(engines) >= sum(not task.done() for _, task in running + late),
                         WAIT_S, "the engines to hold the requests sent while the slot is held")
            migration.finish()
            assert slot_master(group, migration.slot) == migration.target
            after = load.send(jobs[:2])
            outcomes = await load.settle()
            assert outcomes == Counter({"whole": len(running) + len(late) + len(after)}), outcomes
    assert not _errors(logs, caplog), _errors(logs, caplog)
    _check_engines(engines)
