"""Redis without a single point of failure: a master, two replicas and three sentinels (real
redis-server processes on loopback), two engines and two gateways connected through the
sentinels, the tiny model. The master is killed (SIGKILL) while 50 greedy streams are in
flight: every one must finish with exactly the text of an undisturbed run (none lost, none
duplicated, no error), and new requests are served after the failover; then the killed node
comes back as a replica and the promoted master is killed in turn. Before those, the master is
switched on purpose (`pagedserve switch-master`) with 50 streams in flight, counted the same way. Prints (and writes to
artifacts/sentinel.md) the time from each kill to the first token served after it.

About 4 minutes on a quiet 2-core machine: marked `slow`."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import aiohttp
import pytest
import redis

from common.protocol import EngineHeartbeat, Keys
from tests.e2e.faults import ENGINE_ARGS, Cluster, Outcome, Tally, judge, prompt, reference_texts, stream_one
from tests.e2e.support import EngineProcess, GatewayProcess
from tests.fixtures.redis import MASTER_NAME, SentinelGroup

pytestmark = pytest.mark.slow
COUNT = 50
MAX_TOKENS = 160
ROOT = Path(__file__).resolve().parents[2]
NOWHERE = "redis://127.0.0.1:1/0"  # --redis-url is ignored with --redis-sentinel: it must not be used
ROWS: list[str] = []


class SentinelEngine(EngineProcess):
    """An engine on the sentinels; its heartbeat is read from the master of the moment."""

    def __init__(self, group: SentinelGroup, model: Path, engine_id: str, log_dir: Path) -> None:
        self.group = group
        super().__init__(model, NOWHERE, engine_id, log_dir, *ENGINE_ARGS, "--redis-sentinel", group.sentinel_arg,
                         "--redis-sentinel-master", MASTER_NAME)

    def heartbeat(self) -> EngineHeartbeat | None:
        with redis.Redis(port=self.group.master_port()) as client:
            raw = client.hgetall(Keys().engine(self.engine_id))
        return EngineHeartbeat.from_hash(raw) if raw else None


class SentinelCluster(Cluster):
    """`faults.Cluster` with a Sentinel group in place of the single Redis."""

    def __init__(self, model: Path, log_dir: Path) -> None:  # no Redis of its own: not super().__init__
        self.model = model
        self.log_dir = log_dir
        self.group = SentinelGroup()
        self.engines: list[EngineProcess] = []
        self.gateways: list[GatewayProcess] = []
        self._names = 0

    def add_engines(self, count: int) -> None:
        new = [SentinelEngine(self.group, self.model, self._name("eng"), self.log_dir) for _ in range(count)]
        for engine in new:
            engine.wait_ready()
        self.engines += new

    def add_gateways(self, count: int) -> None:
        new = [GatewayProcess(NOWHERE, self._name("gw"), self.log_dir, "--redis-sentinel", self.group.sentinel_arg)
               for _ in range(count)]
        for gateway in new:
            gateway.wait_healthy()
        self.gateways += new

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.group.master_port())

    def stop(self) -> None:
        for proc in [*self.gateways, *self.engines]:
            proc.stop()
        self.group.stop()


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory,
            request: pytest.FixtureRequest) -> Iterator[SentinelCluster]:
    stack = SentinelCluster(tiny_llama_dir, tmp_path_factory.mktemp("sentinel"))
    try:
        stack.add_engines(2)
        stack.add_gateways(2)
        yield stack
    finally:
        stack.stop()
        _report(request)


def _report(request: pytest.FixtureRequest) -> None:
    lines = ["| fault | requests | completed identical | clean errors | lost | duplicated | fault → next token |",
             "|---|---|---|---|---|---|---|", *ROWS]
    out = ROOT / "artifacts" / "sentinel.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    reporter = request.config.pluginmanager.getplugin("terminalreporter")
    if reporter is not None:
        reporter.write_line("")
        for line in lines:
            reporter.write_line(line)


@pytest.fixture(scope="module")
def reference(cluster: SentinelCluster) -> list[str]:
    return asyncio.run(reference_texts(cluster, COUNT, MAX_TOKENS))


class Clock:
    """Stands in for `stream_one`'s `started` event: remembers when each chunk with text came."""

    def __init__(self) -> None:
        self.first = asyncio.Event()
        self.times: list[float] = []

    def set(self) -> None:
        self.times.append(time.monotonic())
        self.first.set()


async def _fault_in_flight(cluster: SentinelCluster, fault: Callable[[], int]) -> tuple[list[Outcome], float, int]:
    """50 streams over both gateways; once each has shown text, `fault()` (it returns the port of
    the master it acted on). Returns the outcomes, the seconds from the fault to the first token
    any client got after it, and that port."""
    timeout = aiohttp.ClientTimeout(total=300, sock_read=120)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        clocks = [Clock() for _ in range(COUNT)]
        tasks = [asyncio.create_task(stream_one(session, cluster.urls[i % 2], prompt(i), MAX_TOKENS,
                                                clocks[i]))  # type: ignore[arg-type]
                 for i in range(COUNT)]
        await asyncio.wait_for(asyncio.gather(*(c.first.wait() for c in clocks)), 240)
        old = await asyncio.to_thread(fault)
        fault_at = time.monotonic()
        outcomes = list(await asyncio.gather(*tasks))
    after = [t for clock in clocks for t in clock.times if t > fault_at]
    assert after, "no token arrived after the fault"
    return outcomes, min(after) - fault_at, old


def switch_master(group: SentinelGroup) -> int:
    """The deliberate switch of docs/deployment.md ("Switching the master on purpose"):
    `pagedserve switch-master` (writes paused, replicas caught up, `SENTINEL FAILOVER`, the old
    master demoted at once, writes unpaused). Returns the old master's port."""
    old = group.master_port()
    done = group.switch_master()
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"from 127.0.0.1:{old} to 127.0.0.1:" in done.stdout, done.stdout
    return old


def _health(url: str) -> dict[str, object]:
    """/health's body; a 503 (the gateway's reader or registry still catching up with the new
    master: a reason, not a failure yet) comes back as {"status": 503, "error": ...}."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as resp:
            body: dict[str, object] = json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        if exc.code != 503:
            raise
        return {"status": 503, "error": json.loads(exc.read()).get("error")}
    return body


async def _wait_healthy_on(url: str, master: str, within_s: float = 30.0) -> dict[str, object]:
    """Poll /health until it is 200 and names `master`, for up to `within_s`; the last body."""
    deadline = time.monotonic() + within_s
    while True:
        body = await asyncio.to_thread(_health, url)
        redis_state = body.get("redis")
        if isinstance(redis_state, dict) and redis_state["master"] == master:
            return body
        if time.monotonic() > deadline:
            return body
        await asyncio.sleep(0.5)


async def _round(cluster: SentinelCluster, reference: list[str], label: str,
                 fault: Callable[[], int] | None = None) -> int:
    outcomes, gap_s, killed = await _fault_in_flight(cluster, fault or cluster.group.kill_master)
    new = await asyncio.to_thread(cluster.group.wait_failover, killed)
    tally = judge(label, outcomes, reference, MAX_TOKENS)
    _record(tally, f"{gap_s:.1f} s")
    assert tally.identical == tally.requests, tally.notes  # no 5xx, no error event, no short text
    assert tally.duplicated == 0 and tally.lost == 0, tally.notes
    for gateway in cluster.gateways:  # /health names the new master and a replica acknowledges writes
        body = await _wait_healthy_on(gateway.url, f"127.0.0.1:{new}")
        redis_state = body.get("redis")
        assert isinstance(redis_state, dict), body
        assert redis_state["mode"] == "sentinel" and redis_state["master"] == f"127.0.0.1:{new}", redis_state
        assert redis_state["writes_acknowledged"] is True and redis_state["master_changes"] >= 1, redis_state
    again = await _run_plain(cluster)
    tally = judge(f"(new requests after: {label})", again, reference, MAX_TOKENS)
    _record(tally, "")
    assert tally.identical == tally.requests, tally.notes
    await asyncio.to_thread(cluster.check_clean)
    return killed


async def _run_plain(cluster: SentinelCluster) -> list[Outcome]:
    timeout = aiohttp.ClientTimeout(total=300, sock_read=120)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        return list(await asyncio.gather(*(stream_one(session, cluster.urls[i % 2], prompt(i), MAX_TOKENS)
                                           for i in range(COUNT))))


def _record(tally: Tally, gap: str) -> None:
    ROWS.append(f"{tally.row()} {gap} |")


async def test_switch_master_on_purpose_with_50_streams_in_flight(cluster: SentinelCluster,
                                                                 reference: list[str]) -> None:
    """The master switched on purpose (`pagedserve switch-master`: `SENTINEL FAILOVER` with the
    writes paused) while 50 streams run: the old master stays up and becomes a replica of the
    promoted one; nothing lost, nothing doubled."""
    old = await _round(cluster, reference, "Sentinel: `pagedserve switch-master` (SENTINEL FAILOVER, writes paused)",
                       lambda: switch_master(cluster.group))
    await asyncio.to_thread(cluster.group.wait_ready, 2)  # the old master rejoined as a replica
    with redis.Redis(port=old) as client:
        assert client.info("replication")["role"] == "slave"


async def test_sigkill_master_with_50_streams_in_flight(cluster: SentinelCluster, reference: list[str]) -> None:
    killed = await _round(cluster, reference, "Sentinel: kill -9 the Redis master")
    await asyncio.to_thread(cluster.group.replace, killed)  # the machine is replaced: a fresh replica
    await asyncio.to_thread(cluster.group.wait_ready, 2)


async def test_sigkill_the_promoted_master_too(cluster: SentinelCluster, reference: list[str]) -> None:
    await _round(cluster, reference, "Sentinel: kill -9 the promoted master")
