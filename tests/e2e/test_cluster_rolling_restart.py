"""A rolling restart of a fleet on a Redis Cluster behind a plain connect-retrying balancer, under
steady streaming load: a 3-master, 3-replica cluster, two engines and two gateways for the tiny
model, each its own process on `--redis-cluster` (plain SIGTERM, no --reuse-port). Looping
clients stream greedy completions through a balancer that sends each request to the next gateway
in turn and on to another only when its connect is refused (as nginx does), while in turn:

1. each engine gets SIGTERM (it drains: running requests are handed back at once,
   `--drain-timeout 0`, and its peer resumes them) and a new one is started;
2. each gateway gets SIGTERM (its listener closes at once, so connects are refused and the
   balancer goes on to the peer; it drains its open streams to their end) and a new one is
   started on a new port, which the balancer then uses instead;
3. `pagedserve switch-master --redis-cluster` moves the master holding the model's request
   stream to its replica (CLUSTER FAILOVER), while new requests keep arriving besides the loops'.

Every request's outcome is counted: none may fail, and each must be exactly the text its prompt
gave before anything was restarted. Each step must meet open streams. Conditions are polled
(heartbeats, /health, exit statuses, request counts, the balancer's refusals); no duration is
asserted."""

from __future__ import annotations

import asyncio
import re
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest
import redis
from redis.cluster import ClusterNode, RedisCluster

from common.protocol import EngineHeartbeat, Keys
from tests.e2e.faults import MODEL, Outcome, prompt, stream_one
from tests.e2e.support import ChildProcess, EngineProcess, GatewayProcess
from tests.e2e.up_support import MAX_TOKENS, Load, same_answers
from tests.fixtures.redis_cluster import RedisClusterGroup

pytestmark = pytest.mark.slow
CLIENTS = 6
KEYS = Keys()
UNUSED_URL = "redis://127.0.0.1:1/0"  # --redis-cluster wins over it
# heartbeats every 1 s: an engine counts as dead after 5 silent ones, far above the switch's pause
ENGINE_ARGS = ("--served-model-name", MODEL, "--kv-cache-memory", "16MiB", "--drain-timeout", "0",
               "--redis-wait-timeout", "2000", "--heartbeat-interval", "1.0")
GATEWAY_ARGS = ("--drain-timeout", "120", "--redis-wait-timeout", "2000")
WAIT_S = 600.0  # only bounds a hang: every wait below is for a condition


def _cluster_client(group: RedisClusterGroup) -> RedisCluster:
    return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in group.addresses], socket_timeout=5)


class ClusterEngine(EngineProcess):
    """`pagedserve engine --redis-cluster ...`; its heartbeat read through a cluster client."""

    def __init__(self, model: Path, group: RedisClusterGroup, engine_id: str, log_dir: Path) -> None:
        self.group = group
        super().__init__(model, UNUSED_URL, engine_id, log_dir, "--redis-cluster", group.nodes_arg, *ENGINE_ARGS)

    def heartbeat(self) -> EngineHeartbeat | None:
        try:
            with _cluster_client(self.group) as client:
                raw = client.hgetall(KEYS.engine(self.engine_id))
        except (redis.RedisError, OSError):
            return None
        return EngineHeartbeat.from_hash(raw) if raw else None


@dataclass
class Balancer:
    """Request number `turn` goes to gateway `turn` mod their number, and to the next one only when
    its connect is refused; anything else is the request's outcome. `urls` is changed in place
    when a gateway is replaced."""

    urls: list[str]
    refused: dict[str, int] = field(default_factory=dict)  # url -> connects refused there
    turns: int = 0

    async def stream(self, session: aiohttp.ClientSession, index: int) -> Outcome:
        turn, self.turns = self.turns, self.turns + 1
        urls = list(self.urls)
        out = Outcome(error="no gateway")
        for i in range(len(urls)):
            url = urls[(turn + i) % len(urls)]
            out = await stream_one(session, url, prompt(index), MAX_TOKENS)
            if not out.refused:
                return out
            self.refused[url] = self.refused.get(url, 0) + 1
        return out  # every gateway refused it: a failure


@dataclass
class BalancedLoad(Load):
    """`Load`'s looping clients and arrivals, through the balancer."""

    balancer: Balancer = field(default_factory=lambda: Balancer([]))

    async def send(self, session: aiohttp.ClientSession, index: int) -> Outcome:
        return await self.balancer.stream(session, index)


@dataclass
class Fleet:
    """The cluster, the engines and gateways that should be running, and the stopped ones."""

    group: RedisClusterGroup
    model: Path
    log_dir: Path
    engines: list[ClusterEngine] = field(default_factory=list)
    gateways: list[GatewayProcess] = field(default_factory=list)
    stopped: list[ChildProcess] = field(default_factory=list)
    started: int = 0

    def new_engine(self) -> ClusterEngine:
        self.started += 1
        engine = ClusterEngine(self.model, self.group, f"cr-{self.started}", self.log_dir)
        self.engines.append(engine)
        return engine

    def new_gateway(self) -> GatewayProcess:
        self.started += 1
        gateway = GatewayProcess(UNUSED_URL, f"cr-gw-{self.started}", self.log_dir, "--redis-cluster",
                                 self.group.nodes_arg, *GATEWAY_ARGS)
        self.gateways.append(gateway)
        return gateway

    def sigterm(self, proc: ChildProcess) -> None:
        """SIGTERM `proc`, which from now on may exit."""
        proc.proc.send_signal(signal.SIGTERM)
        if isinstance(proc, ClusterEngine):
            self.engines.remove(proc)
        elif isinstance(proc, GatewayProcess):
            self.gateways.remove(proc)
        self.stopped.append(proc)

    def check_running(self) -> None:
        for proc in [*self.engines, *self.gateways]:
            assert proc.proc.poll() is None, f"{proc.log_path.name} exited ({proc.proc.returncode}): {proc.log_tail()}"

    def stop(self) -> None:
        for proc in [*self.gateways, *self.engines, *self.stopped]:
            proc.stop()
        self.group.stop()


@pytest.fixture
def fleet(tiny_llama_dir: Path, tmp_path: Path) -> Iterator[Fleet]:
    group = RedisClusterGroup(masters=3, replicas=1, node_timeout_ms=1000)
    fleet = Fleet(group, tiny_llama_dir, tmp_path)
    try:
        engines = [fleet.new_engine() for _ in range(2)]
        gateways = [fleet.new_gateway() for _ in range(2)]
        for engine in engines:
            engine.wait_ready(timeout=WAIT_S)
        for gateway in gateways:
            gateway.wait_healthy(timeout=WAIT_S)
        yield fleet
    finally:
        fleet.stop()


async def _until(condition: Callable[[], bool], what: str, fleet: Fleet) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        fleet.check_running()
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def _progress(load: Load, requests: int, fleet: Fleet) -> None:
    """Until `requests` more requests have ended (the fleet serves)."""
    target = len(load.results) + requests
    await _until(lambda: len(load.results) >= target, f"{requests} more requests", fleet)


async def _exit_status(proc: ChildProcess) -> int:
    return int(await asyncio.to_thread(proc.proc.wait, WAIT_S))


async def _replace_engine(fleet: Fleet, old: ClusterEngine, load: Load) -> int:
    """SIGTERM `old`, start a new engine; the requests open at the SIGTERM."""
    open_now = load.open_now
    fleet.sigterm(old)
    new = fleet.new_engine()
    assert await _exit_status(old) == 0, old.log_tail()
    await asyncio.to_thread(new.wait_ready, WAIT_S)
    await _progress(load, 2 * CLIENTS, fleet)
    return open_now


async def _replace_gateway(fleet: Fleet, old: GatewayProcess, load: BalancedLoad) -> int:
    """SIGTERM `old`, start a new gateway on a new port; once a connect to `old` was refused (the
    balancer went on to the peer) and the new one answers, the balancer uses it instead. The
    requests open at the SIGTERM."""
    balancer = load.balancer
    refused = balancer.refused.get(old.url, 0)
    open_now = load.open_now
    fleet.sigterm(old)
    new = fleet.new_gateway()
    await _until(lambda: balancer.refused.get(old.url, 0) > refused, "a connect refused by the stopped gateway",
                 fleet)
    await asyncio.to_thread(new.wait_healthy, WAIT_S)
    balancer.urls[balancer.urls.index(old.url)] = new.url
    assert await _exit_status(old) == 0, old.log_tail()
    await _progress(load, 2 * CLIENTS, fleet)
    return open_now


def _leftovers(fleet: Fleet) -> dict[str, object]:
    """Engine ids with a heartbeat, entries on the model's request streams, checkpoints."""
    with _cluster_client(fleet.group) as client:
        engines = sorted(k.decode().split("{e:", 1)[1].rsplit("}:", 1)[0]
                         for k in client.scan_iter(match=KEYS.engine_pattern))
        routed = [m.decode() for m in client.smembers(KEYS.routed_streams(MODEL))]
        queued = sum(int(client.xlen(s)) for s in [KEYS.requests(MODEL), *routed])
        progress = len(list(client.scan_iter(match=KEYS.progress_pattern)))
    return {"engines": engines, "queued": queued, "progress_keys": progress}


async def test_rolling_restart_of_a_cluster_fleet_behind_a_retrying_balancer(fleet: Fleet) -> None:
    group = fleet.group
    balancer = Balancer([g.url for g in fleet.gateways])
    reference = await same_answers(balancer.urls[0])  # the undisturbed run
    load = BalancedLoad(balancer.urls[0], balancer=balancer)
    clients = [asyncio.create_task(load.client(k)) for k in range(CLIENTS)]
    open_at: dict[str, int] = {}
    try:
        await _progress(load, 2 * CLIENTS, fleet)
        for old in list(fleet.engines):
            open_at[f"engine {old.engine_id}"] = await _replace_engine(fleet, old, load)
        for old_gateway in list(fleet.gateways):
            open_at[f"gateway {old_gateway.gateway_id}"] = await _replace_gateway(fleet, old_gateway, load)
        victim = group.master_of(KEYS.requests(MODEL))
        open_at["switch-master"] = load.open_now
        switch = asyncio.ensure_future(asyncio.to_thread(group.switch_master, "--master", f"127.0.0.1:{victim}"))
        await load.arrivals(switch)  # new requests keep arriving while the master's writes are paused
        done = await switch
        assert done.returncode == 0, done.stderr[-3000:]
        await _progress(load, 2 * CLIENTS, fleet)
    finally:
        load.stop.set()
        await asyncio.gather(*clients)

    failed = load.failed(reference)
    logs = [p.log_tail(10**7) for p in [*fleet.stopped, *fleet.engines, *fleet.gateways]]
    handed_back = sum(len(re.findall(r"handing requests back.*requests=[1-9]", log)) for log in logs)
    resent = sum(log.count("refused by a demoted master; sending it to the new one") for log in logs)
    took = re.search(r"switched.*seconds=([\d.]+)", done.stderr)
    print(f"\ncluster fleet restart (2 engines, 2 gateways, then the model's master) behind a retrying balancer "
          f"under {CLIENTS} looping clients: {len(load.results)} requests, {len(load.results) - len(failed)} "
          f"identical to the undisturbed run, {len(failed)} not; open when each step began: {open_at}; connects "
          f"refused and sent on: {sum(balancer.refused.values())}; engine stops that handed requests back: "
          f"{handed_back}; {done.stdout.strip()} in {took.group(1) if took else '?'} s, submits answered MOVED by the "
          f"old master and sent to the new one: {resent}")
    assert failed == [], failed[:5]
    assert len(open_at) == 5 and all(n > 0 for n in open_at.values()), open_at  # every step met load
    new_master = group.master_of(KEYS.requests(MODEL))
    assert new_master != victim and f"to 127.0.0.1:{new_master}" in done.stdout, done.stdout
    with redis.Redis(port=victim) as client:
        assert client.info("replication")["role"] == "slave"
    want = {"engines": sorted(e.engine_id for e in fleet.engines), "queued": 0, "progress_keys": 0}
    await _until(lambda: _leftovers(fleet) == want, f"only the new engines left, nothing queued: {want}", fleet)
