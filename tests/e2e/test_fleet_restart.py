"""The whole fleet restarted under steady streaming load (issue 40, "done when"): a Sentinel group
(a master, two replicas, three sentinels), two `pagedserve up` stacks (`--name a`, `--name b`)
on those sentinels and on one port (every gateway of `up` listens with --reuse-port): two
engines, two gateways, the tiny model. Looping clients stream greedy completions through that
port while, in turn, as an operator does it (docs/deployment.md, "Restarting the whole fleet"):

1. SIGHUP to `up` a: its engine is replaced (replacement first, then SIGTERM: the old one drains
   and hands back what it still runs), then its gateway (a new one on the port, then SIGTERM: the
   old one drains its streams to their end);
2. SIGHUP to `up` b: the same for the other engine and gateway;
3. `pagedserve switch-master`: the Redis master moves to a replica (writes paused meanwhile),
   while new requests keep arriving besides the looping clients'.

Every request's outcome is counted: none may fail, and each must be exactly the text its prompt
gave before anything was restarted. Each step must meet open streams. Conditions are polled (log
lines, /health, request counts); no duration is asserted."""

from __future__ import annotations

import asyncio
import re
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from common.ports import free_port
from common.protocol import Keys
from tests.e2e.faults import MODEL
from tests.e2e.up_support import Load, Up, same_answers
from tests.fixtures.redis import MASTER_NAME, SentinelGroup

pytestmark = pytest.mark.slow
CLIENTS = 6
NAMES = ("a", "b")
# the default --heartbeat-interval (1 s): an engine is taken for dead after 5 silent intervals, and
# switch-master holds the writes (heartbeats included) for about 2 s (docs/deployment.md)
ENGINE_ARGS = "--dtype float32 --drain-timeout 1"
KEYS = Keys()


@pytest.fixture
def fleet(tiny_llama_dir: Path, tmp_path: Path) -> Iterator[tuple[SentinelGroup, list[Up]]]:
    group = SentinelGroup()
    port = free_port()
    ups: list[Up] = []
    try:
        sentinels = ["--redis-sentinel", group.sentinel_arg, "--redis-sentinel-master", MASTER_NAME]
        ups = [Up(tiny_llama_dir, sentinels, tmp_path / f"up-{name}.log", "--name", name, port=port,
                  engine_args=ENGINE_ARGS) for name in NAMES]
        for up in ups:  # each `up` waits for its own gateway to answer on the shared port
            up.wait_for("Ctrl-C stops everything")
        yield group, ups
    finally:
        codes = [up.stop() for up in ups]
        group.stop()
        assert codes == [0] * len(ups), [up.text()[-3000:] for up in ups]


def _engine_ids(master: int) -> list[str]:
    with redis.Redis(port=master) as client:
        found = client.scan_iter(match=KEYS.engine_pattern)  # ps:{e:<id>}:engine
        return sorted(k.decode().split("{e:", 1)[1].rsplit("}:", 1)[0] for k in found)


async def _restart(up: Up, load: Load, ups: list[Up]) -> dict[str, int]:
    """SIGHUP `up` and wait for its restart to finish, then for the load to go on; the requests
    open when each old process was told to stop."""
    seen: dict[str, int] = {}
    up.proc.send_signal(signal.SIGHUP)
    while up.count("rolling restart: done") < 1:
        assert up.proc.poll() is None, up.text()[-3000:]
        assert "rolling restart: failed" not in up.text(), up.text()[-3000:]
        for step in ("stopping the old engine", "stopping the old gateway"):
            if step not in seen and up.count(step):
                seen[step] = load.open_now
        await asyncio.sleep(0.05)
    await load.progress(2 * CLIENTS, ups)
    return seen


async def test_every_engine_gateway_and_the_master_restarted_in_turn_under_load(
        fleet: tuple[SentinelGroup, list[Up]]) -> None:
    group, ups = fleet
    url = ups[0].url  # the port both stacks share
    first_master = group.master_port()
    assert _engine_ids(first_master) == ["a-engine-0", "b-engine-0"]
    reference = await same_answers(url)  # the undisturbed run

    load = Load(url)
    clients = [asyncio.create_task(load.client(k)) for k in range(CLIENTS)]
    open_at: dict[str, int] = {}
    try:
        await load.progress(2 * CLIENTS, ups)
        for name, up in zip(NAMES, ups, strict=True):
            for step, count in (await _restart(up, load, ups)).items():
                open_at[f"up {name}: {step}"] = count
        open_at["switch-master"] = load.open_now
        switch = asyncio.ensure_future(asyncio.to_thread(group.switch_master))
        await load.arrivals(switch)  # new requests keep arriving while the writes are paused
        done = await switch
        assert done.returncode == 0, done.stderr[-3000:]
        await load.progress(2 * CLIENTS, ups)
    finally:
        load.stop.set()
        await asyncio.gather(*clients)

    failed = load.failed(reference)
    resent = sum(up.count("refused by a demoted master; sending it to the new one") for up in ups)
    paused = re.search(r"writes unpaused.*paused_s=([\d.]+)", done.stderr)
    print(f"\nfleet restart (engine and gateway of up a, then of up b, then switch-master) under {CLIENTS} looping "
          f"clients: {len(load.results)} requests, {len(load.results) - len(failed)} identical to the undisturbed "
          f"run, {len(failed)} not; open when each step began: {open_at}; {done.stdout.strip()}, writes paused "
          f"{paused.group(1) if paused else '?'} s; submits refused by "
          f"the demoted master and sent to the new one: {resent}")
    assert failed == [], failed[:5]
    assert len(open_at) == 5 and all(n > 0 for n in open_at.values()), open_at  # every step met load
    master = group.master_port()
    assert master != first_master
    with redis.Redis(port=first_master) as client:
        assert client.info("replication")["role"] == "slave"
    for up in ups:
        log = up.text()
        assert log.count("old engine exited") == 1 and log.count("old gateway exited") == 1, log[-3000:]
    assert _engine_ids(master) == ["a-engine-1", "b-engine-1"]  # the old engines left
    with redis.Redis(port=master) as client:  # nothing left queued, pending or checkpointed
        routed = [m.decode() for m in client.smembers(KEYS.routed_streams(MODEL))]
        assert [client.xlen(s) for s in [KEYS.requests(MODEL), *routed]] == [0] * (1 + len(routed))
        assert not list(client.scan_iter(match=KEYS.progress_pattern))
