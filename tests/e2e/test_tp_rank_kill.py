"""A served tensor-parallel engine whose rank 1 is killed mid-generation: real redis-server, a
TP=2 engine and a single-process engine (`pagedserve engine`), one gateway, greedy streams. The
TP engine exits at once (status `EXIT_RANK_FAILED`), its heartbeat stops, and its requests resume
on the other engine as after an engine kill -9: every request ends with exactly the text of an
undisturbed run (no token lost or shown twice). Marked slow (three processes start, ~1 minute)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from engine.parallel import EXIT_RANK_FAILED
from pagedserve.launch.redis_server import RedisServer
from tests.e2e.faults import ENGINE_ARGS, MODEL, Outcome, judge, prompt, sleep_until, stream_one
from tests.e2e.support import EngineProcess, GatewayProcess, pending_by_engine

pytestmark = pytest.mark.slow
COUNT = 16
MAX_TOKENS = 96


class Stack:
    def __init__(self, model: Path, log_dir: Path) -> None:
        self.redis = RedisServer().start()
        self.tp = EngineProcess(model, self.redis.url, "eng-tp2", log_dir, *ENGINE_ARGS,
                                "--tensor-parallel-size", "2", "--tensor-parallel-threads", "1")
        self.single = EngineProcess(model, self.redis.url, "eng-single", log_dir, *ENGINE_ARGS)
        self.gateway = GatewayProcess(self.redis.url, "gw-tp", log_dir)
        for proc in (self.tp, self.single):
            proc.wait_ready()
        self.gateway.wait_healthy()

    def stop(self) -> None:
        for proc in (self.gateway, self.tp, self.single):
            proc.stop()
        self.redis.stop()


@pytest.fixture(scope="module")
def stack(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(tiny_llama_dir, tmp_path_factory.mktemp("tp-kill"))
    try:
        yield s
    finally:
        s.stop()


def rank_pids(engine_pid: int) -> list[int]:
    """The engine's spawned ranks (its children running multiprocessing's spawn entry point; the
    engine thread spawned them, so they are listed under that thread's task)."""
    tasks = Path(f"/proc/{engine_pid}/task").iterdir()
    children = [c for task in tasks for c in (task / "children").read_text().split()]
    return [int(c) for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]


async def _run(url: str, fault: asyncio.Future[None] | None) -> list[Outcome]:
    timeout = aiohttp.ClientTimeout(total=300, sock_read=120)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        started = [asyncio.Event() for _ in range(COUNT)]
        tasks = [asyncio.create_task(stream_one(session, url, prompt(i), MAX_TOKENS, started[i])) for i in range(COUNT)]
        await asyncio.wait_for(asyncio.gather(*(s.wait() for s in started)), 240)
        if fault is not None:
            fault.set_result(None)
        return list(await asyncio.gather(*tasks))


def test_killing_rank_1_moves_its_requests_to_the_other_engine(stack: Stack) -> None:
    reference = [o.text for o in asyncio.run(_run(stack.gateway.url, None))]
    assert len(set(reference)) > 1

    async def with_kill() -> list[Outcome]:
        go: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        run = asyncio.create_task(_run(stack.gateway.url, go))
        await go
        held = pending_by_engine(stack.redis.url, MODEL).get(stack.tp.engine_id, 0)
        assert held > 0, "the TP engine holds no request: the kill would test nothing"
        (rank1,) = rank_pids(stack.tp.proc.pid)
        os.kill(rank1, signal.SIGKILL)
        killed_at = time.monotonic()
        await asyncio.to_thread(sleep_until, lambda: stack.tp.proc.poll() is not None, 30, "TP engine still up")
        exit_after.append(time.monotonic() - killed_at)
        return await run

    exit_after: list[float] = []
    outcomes = asyncio.run(with_kill())
    tally = judge("kill -9 of a TP engine's rank 1", outcomes, reference, MAX_TOKENS)
    assert tally.duplicated == 0 and tally.lost == 0, tally.notes
    assert tally.identical == COUNT, tally.notes
    assert stack.tp.proc.returncode == EXIT_RANK_FAILED, stack.tp.log_tail()
    assert exit_after[0] < 10, exit_after
    assert "tensor-parallel group failed" in stack.tp.log_tail(200_000)
    assert "resuming request" in stack.single.log_tail(400_000)
    stack.single.wait_drained(60)
