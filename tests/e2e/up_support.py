"""End-to-end support for `pagedserve up` under load: a real `up` process logging to a file,
looping streaming clients that record every request's outcome, and the verdict of each against
an undisturbed run of the same prompts."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from common.ports import free_port
from tests.e2e.faults import MODEL, Outcome, prompt, stream_one
from tests.e2e.support import ROOT

PROMPTS = 12
MAX_TOKENS = 64
ENGINE_ARGS = "--dtype float32 --heartbeat-interval 0.5 --drain-timeout 1"
GATEWAY_ARGS = "--request-timeout 300 --drain-timeout 120"


class Up:
    """`pagedserve up` on the tiny model, its Redis given by `redis_args` (`--redis-url URL` or
    `--redis-sentinel ...`), on `port` (a free one by default), logging to `log_path`; the
    engines get `engine_args`."""

    def __init__(self, model: Path, redis_args: list[str], log_path: Path, *extra: str,
                 port: int | None = None, engine_args: str = ENGINE_ARGS) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pagedserve.cli", "up", "--port", str(self.port), "--model", str(model),
             "--served-model-name", MODEL, "--device", "cpu", "--kv-cache-memory", "16MiB", *redis_args,
             "--ready-timeout", "240", "--engine-args", engine_args, "--gateway-args", GATEWAY_ARGS, *extra],
            cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def count(self, needle: str) -> int:
        return self.text().count(needle)

    def wait_for(self, needle: str, times: int = 1, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while self.count(needle) < times:
            assert self.proc.poll() is None, f"up exited ({self.proc.returncode}): {self.text()[-3000:]}"
            assert time.monotonic() < deadline, f"no {needle!r} x{times} in up's log: {self.text()[-3000:]}"
            time.sleep(0.1)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return int(self.proc.returncode)


@dataclass
class Load:
    """Looping clients on `url`; every request's prompt index and outcome, and how many are open now."""

    url: str
    results: list[tuple[int, Outcome]] = field(default_factory=list)
    open_now: int = 0
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def send(self, session: aiohttp.ClientSession, index: int) -> Outcome:
        """One streamed request of prompt `index` (a subclass may send it elsewhere than `url`)."""
        return await stream_one(session, self.url, prompt(index), MAX_TOKENS)

    async def client(self, k: int, limit: int | None = None) -> None:
        """Client `k` streams prompts one after another until `stop` (or `limit` requests)."""
        timeout = aiohttp.ClientTimeout(total=300, sock_read=120)
        async with aiohttp.ClientSession(timeout=timeout) as session:  # keep-alive, as real clients
            i = 0
            while not self.stop.is_set() and (limit is None or i < limit):
                index = (k * 5 + i) % PROMPTS
                i += 1
                self.open_now += 1
                try:
                    out = await self.send(session, index)
                finally:
                    self.open_now -= 1
                self.results.append((index, out))

    async def arrivals(self, until: asyncio.Future[object], every_s: float = 0.05, most: int = 40) -> None:
        """New single requests, one every `every_s` (up to `most`), until `until` is done: they
        arrive during whatever `until` is doing (a master switch), not only after it."""
        timeout = aiohttp.ClientTimeout(total=300, sock_read=120)
        async with aiohttp.ClientSession(timeout=timeout) as session:

            async def one(index: int) -> None:
                self.results.append((index, await self.send(session, index)))

            started = []
            while not until.done() and len(started) < most:
                started.append(asyncio.create_task(one(len(started) % PROMPTS)))
                await asyncio.wait([until], timeout=every_s)
            await asyncio.gather(*started)

    async def progress(self, requests: int, alive: list[Up]) -> None:
        """Until `requests` more requests have ended (the stack serves), while each of `alive` runs."""
        target = len(self.results) + requests
        while len(self.results) < target:
            for up in alive:
                assert up.proc.poll() is None, f"up exited ({up.proc.returncode}): {up.text()[-3000:]}"
            await asyncio.sleep(0.05)

    def failed(self, reference: list[str]) -> list[tuple[int, Outcome]]:
        """The requests that did not end whole ([DONE], no error, every token) with their reference text."""
        return [(i, o) for i, o in self.results
                if not (o.done and o.error is None and o.tokens == MAX_TOKENS and o.text == reference[i])]


async def same_answers(url: str, reference: list[str] | None = None) -> list[str]:
    """Each prompt once, concurrently: all must finish whole (and equal `reference` when given)."""
    timeout = aiohttp.ClientTimeout(total=300, sock_read=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        outs = await asyncio.gather(*(stream_one(session, url, prompt(i), MAX_TOKENS) for i in range(PROMPTS)))
    assert all(o.done and o.error is None and o.tokens == MAX_TOKENS for o in outs), outs
    texts = [o.text for o in outs]
    assert reference is None or texts == reference
    return texts
