"""Fault injection with real processes: redis-server (AOF, fsync always), two engines, two
gateways, the tiny model. Each fault strikes while 50 greedy streams are in flight; every
request must either finish with exactly the text of an undisturbed run or end with a clean
error, never show a token twice or miss one; afterwards no engine holds a block, the
request stream is empty and no checkpoint is left. The table of verdicts is printed at the
end of the module (and written to artifacts/faults.md).

The tests share one cluster and run in file order; a fault that removes a process puts a
fresh one back before the next test. About 5 minutes on a quiet 2-core machine (9 under
load): marked `slow`, CI runs them in a second pytest call (scripts/test.sh)."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.faults import MODEL, Cluster, Tally, judge, reference_texts, run_with_fault
from tests.e2e.support import EngineProcess, owner_of_most

pytestmark = pytest.mark.slow
COUNT = 50
MAX_TOKENS = 160
TALLIES: list[Tally] = []
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory,
            request: pytest.FixtureRequest) -> Iterator[Cluster]:
    stack = Cluster(tiny_llama_dir, tmp_path_factory.mktemp("faults"))
    try:
        stack.add_engines(2)
        stack.add_gateways(2)
        yield stack
    finally:
        stack.stop()
        _print_table(request)


def _print_table(request: pytest.FixtureRequest) -> None:
    lines = ["| fault | requests | completed identical | clean errors | lost | duplicated |",
             "|---|---|---|---|---|---|", *(t.row() for t in TALLIES)]
    out = ROOT / "artifacts" / "faults.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    reporter = request.config.pluginmanager.getplugin("terminalreporter")
    if reporter is not None:
        reporter.write_line("")
        for line in lines:
            reporter.write_line(line)


@pytest.fixture(scope="module")
def reference(cluster: Cluster) -> list[str]:
    return asyncio.run(reference_texts(cluster, COUNT, MAX_TOKENS))


def _record(tally: Tally, cluster: Cluster, *, all_identical: bool) -> None:
    TALLIES.append(tally)
    assert tally.duplicated == 0 and tally.lost == 0, tally.notes
    if all_identical:
        assert tally.identical == tally.requests, tally.notes
    cluster.check_clean()


async def test_client_kill_of_the_gateway_output_connection(cluster: Cluster, reference: list[str]) -> None:
    name = f"ps-out-{cluster.gateways[0].gateway_id}"

    async def fault() -> None:
        with cluster.client() as client:
            for _ in range(3):  # kill it, wait until it is back, three times
                for _ in range(100):
                    ids = [c["id"] for c in client.client_list() if c.get("name") == name]
                    if ids:
                        break
                    await asyncio.sleep(0.1)
                assert ids, "the gateway's output reader connection is not named"
                for client_id in ids:
                    client.client_kill_filter(_id=client_id)

    outcomes = await run_with_fault(cluster, COUNT, MAX_TOKENS, fault)
    _record(judge("CLIENT KILL of a gateway's output connection (x3)", outcomes, reference, MAX_TOKENS),
            cluster, all_identical=True)


async def test_redis_restart_with_aof(cluster: Cluster, reference: list[str]) -> None:
    async def fault() -> None:
        await asyncio.to_thread(cluster.redis.restart, True, signal.SIGKILL)

    outcomes = await run_with_fault(cluster, COUNT, MAX_TOKENS, fault)
    _record(judge("Redis kill -9 + restart with AOF", outcomes, reference, MAX_TOKENS), cluster, all_identical=True)


def busiest(cluster: Cluster) -> EngineProcess:
    """The engine holding the most requests now (from the stream's pending entries)."""
    return owner_of_most(cluster.redis.url, MODEL, cluster.engines)


async def test_sigstop_engine_past_the_heartbeat_window(cluster: Cluster, reference: list[str]) -> None:
    victims: list[EngineProcess] = []

    async def fault() -> None:
        victims.append(victim := busiest(cluster))
        victim.proc.send_signal(signal.SIGSTOP)
        try:
            await asyncio.sleep(6.0)  # > 5 heartbeat intervals (2.5 s): the other engine takes over
        finally:
            victim.proc.send_signal(signal.SIGCONT)

    outcomes = await run_with_fault(cluster, COUNT, MAX_TOKENS, fault)
    _record(judge("SIGSTOP engine 6 s (window 2.5 s), SIGCONT", outcomes, reference, MAX_TOKENS), cluster,
            all_identical=True)
    assert "resuming request" in "".join(e.log_tail(400_000) for e in cluster.engines)


async def test_kill_9_engine(cluster: Cluster, reference: list[str]) -> None:
    victims: list[EngineProcess] = []

    async def fault() -> None:
        victims.append(victim := busiest(cluster))
        victim.kill()

    outcomes = await run_with_fault(cluster, COUNT, MAX_TOKENS, fault)
    cluster.engines.remove(victims[0])
    _record(judge("kill -9 engine", outcomes, reference, MAX_TOKENS), cluster, all_identical=True)
    await asyncio.to_thread(cluster.add_engines, 1)


async def test_sigterm_drain_hands_requests_back(cluster: Cluster, reference: list[str]) -> None:
    victims: list[EngineProcess] = []

    async def fault() -> None:
        victims.append(victim := busiest(cluster))
        victim.proc.send_signal(signal.SIGTERM)  # --drain-timeout 0: what runs is handed back at once

    outcomes = await run_with_fault(cluster, COUNT, MAX_TOKENS, fault)
    victim = victims[0]
    assert await asyncio.to_thread(victim.proc.wait, 60) == 0
    cluster.engines.remove(victim)
    _record(judge("SIGTERM engine (drain 1 s, then hand back)", outcomes, reference, MAX_TOKENS), cluster,
            all_identical=True)
    assert "drain timeout: handing requests back" in victim.log_tail(400_000)
    await asyncio.to_thread(cluster.add_engines, 1)


async def test_kill_9_gateway(cluster: Cluster, reference: list[str]) -> None:
    victim = cluster.gateways[0]

    async def fault() -> None:
        victim.kill()

    outcomes = await run_with_fault(cluster, COUNT, MAX_TOKENS, fault)
    via_victim = set(range(0, COUNT, 2))
    tally = judge("kill -9 gateway (its clients' connections drop)", outcomes, reference, MAX_TOKENS, via_victim)
    others = [outcomes[i] for i in range(1, COUNT, 2)]
    assert all(o.done and o.error is None for o in others), "a request through the surviving gateway failed"
    cluster.gateways.remove(victim)
    _record(tally, cluster, all_identical=False)  # drained: the engines dropped the dead gateway's requests
    await asyncio.to_thread(cluster.add_gateways, 1)


async def test_redis_restart_without_persistence(cluster: Cluster, reference: list[str]) -> None:
    async def fault() -> None:
        await asyncio.to_thread(cluster.redis.restart, False, signal.SIGKILL)

    outcomes = await run_with_fault(cluster, COUNT, MAX_TOKENS, fault)
    tally = judge("Redis kill -9 + restart, data lost", outcomes, reference, MAX_TOKENS)
    errors = {o.error for o in outcomes if o.error is not None}
    assert errors <= {"redis_restarted"}, errors
    _record(tally, cluster, all_identical=False)
    await asyncio.to_thread(cluster.wait_healthy)
    again = await run_with_fault(cluster, COUNT, MAX_TOKENS, _nothing)
    _record(judge("(new requests after the data loss)", again, reference, MAX_TOKENS), cluster, all_identical=True)


async def _nothing() -> None:
    return None
