"""What the Redis queue costs per request and per generated token: a real redis-server, engines
(one real engine on a model, or `--fake-engines N` fake ones at `--engine-tok-s` tokens a second
each: the real engine worker around a model-less engine, `benchmarks/serving/fake_engine.py`), one
or more real gateways, and a burst of streaming completions. From Redis's own counters (INFO
commandstats, stats, cpu) read before and after, it prints JSON lines:

- ``phase: idle``: the background cost per second with nothing to serve (heartbeats, liveness
  keys, the gateways' watch and the blocking reads), measured over `--idle-s` seconds;
- ``phase: burst``: per request and per generated token, the commands (by command and by source:
  submission, request reads, output entries, checkpoints, acks, transactions, heartbeats), bytes
  in and out, and the Redis process's CPU µs, the background of the burst's duration taken off;
  the Redis CPU share of one core during the burst, and the delivered tokens/s one master could
  carry at its measured CPU per token (``saturation_tok_s``).

    python benchmarks/serving/redis_cost.py --requests 200 --max-tokens 64               # tiny random model
    python benchmarks/serving/redis_cost.py --fake-engines 4 --engine-tok-s 1000,4000 --gateways 2

Commands run inside MULTI/EXEC and Lua scripts are counted one by one by Redis; the submit script's
XADD, GET and EXISTS (one each per request) are counted as submission, the other XADDs as output
entries, the other GETs and EXISTS as the flush's probes and fence (transactions). The command µs
of EXEC and EVALSHA include the commands run inside them, so the sources' µs overlap; the Redis
process's CPU (``cpu_us``, network reads and writes included) is the figure to size a master by."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import redis
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout's root: benchmarks.* importable
from benchmarks.serving.burst_bench import ROOT, _healthy, _start
from common.ports import free_port
from common.protocol import Keys
from gateway.clients.sse_reader import SSE_DONE, sse_payloads
from pagedserve.launch.redis_server import RedisServer

MODEL = "bench"
SOURCES: dict[str, str] = {
    "evalsha": "submission", "eval": "submission", "xgroup": "submission", "xlen": "submission",
    "xreadgroup": "request_reads", "xautoclaim": "request_reads", "xclaim": "request_reads",
    "xpending": "request_reads", "xrange": "request_reads", "xrevrange": "request_reads",
    "xadd": "output_entries", "pexpire": "output_entries", "xread": "output_entries", "xtrim": "output_entries",
    "rpush": "checkpoints", "expire": "checkpoints", "ltrim": "checkpoints", "lrange": "checkpoints",
    "del": "checkpoints",
    "xack": "acks", "xdel": "acks",
    "multi": "transactions", "exec": "transactions", "watch": "transactions", "unwatch": "transactions",
    "get": "transactions", "exists": "transactions",
    # heartbeats, engine discovery, liveness keys, the gateways' watch: mostly the idle background
    "hset": "heartbeats", "zadd": "heartbeats", "zrange": "heartbeats", "zrangebyscore": "heartbeats",
    "zremrangebyscore": "heartbeats", "hgetall": "heartbeats", "smembers": "heartbeats", "xinfo": "heartbeats",
    "set": "heartbeats", "time": "heartbeats", "ping": "heartbeats",
    "client": "connections", "hello": "connections", "script": "connections",
    "publish": "aborts", "subscribe": "aborts",
}
OWN = ("info",)  # this script's own readings
PER_REQUEST_IN_SCRIPT = ("xadd", "get", "exists")  # the submit script runs each once per request


@dataclass(slots=True)
class Counters:
    """Redis's counters at one moment."""

    calls: dict[str, int] = field(default_factory=dict)
    usec: dict[str, int] = field(default_factory=dict)
    net_in: int = 0
    net_out: int = 0
    cpu_s: float = 0.0  # the process, every thread
    cpu_main_s: float = 0.0  # the main thread: what saturates first
    at: float = 0.0

    @classmethod
    def read(cls, client: redis.Redis) -> Counters:
        out = cls(at=time.monotonic())
        for key, value in client.info("commandstats").items():
            name = key.removeprefix("cmdstat_")
            if name in OWN:
                continue
            out.calls[name], out.usec[name] = int(value["calls"]), int(value["usec"])
        stats, cpu = client.info("stats"), client.info("cpu")
        out.net_in, out.net_out = int(stats["total_net_input_bytes"]), int(stats["total_net_output_bytes"])
        out.cpu_s = float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"])
        out.cpu_main_s = float(cpu.get("used_cpu_sys_main_thread", cpu["used_cpu_sys"])) + float(
            cpu.get("used_cpu_user_main_thread", cpu["used_cpu_user"]))
        return out


@dataclass(slots=True)
class Cost:
    """What Redis did between two readings, as rates or totals (scaled by `per`)."""

    calls: dict[str, float]
    usec: dict[str, float]
    net_in: float
    net_out: float
    cpu_us: float
    cpu_main_us: float

    @classmethod
    def between(cls, a: Counters, b: Counters) -> Cost:
        names = set(b.calls)
        calls = {n: float(b.calls[n] - a.calls.get(n, 0)) for n in names}
        usec = {n: float(b.usec[n] - a.usec.get(n, 0)) for n in names}
        return cls({n: c for n, c in calls.items() if c}, {n: usec[n] for n in names if calls[n]},
                   float(b.net_in - a.net_in), float(b.net_out - a.net_out), 1e6 * (b.cpu_s - a.cpu_s),
                   1e6 * (b.cpu_main_s - a.cpu_main_s))

    def scaled(self, factor: float) -> Cost:
        return Cost({n: c * factor for n, c in self.calls.items()}, {n: u * factor for n, u in self.usec.items()},
                    self.net_in * factor, self.net_out * factor, self.cpu_us * factor, self.cpu_main_us * factor)

    def minus(self, other: Cost) -> Cost:
        names = set(self.calls) | set(other.calls)
        return Cost({n: self.calls.get(n, 0.0) - other.calls.get(n, 0.0) for n in names},
                    {n: self.usec.get(n, 0.0) - other.usec.get(n, 0.0) for n in names},
                    self.net_in - other.net_in, self.net_out - other.net_out, self.cpu_us - other.cpu_us,
                    self.cpu_main_us - other.cpu_main_us)

    def by_source(self, requests: int) -> dict[str, dict[str, float]]:
        """Calls and command µs grouped by source (`SOURCES`; the rest: ``other``)."""
        out: dict[str, dict[str, float]] = {}

        def add(source: str, calls: float, usec: float) -> None:
            row = out.setdefault(source, {"calls": 0.0, "usec": 0.0})
            row["calls"] += calls
            row["usec"] += usec

        for name, calls in self.calls.items():
            usec = self.usec.get(name, 0.0)
            if name in PER_REQUEST_IN_SCRIPT and calls > 0:
                share = min(1.0, requests / calls)
                add("submission", calls * share, usec * share)
                calls, usec = calls * (1 - share), usec * (1 - share)
            add(SOURCES.get(name, "other"), calls, usec)
        return out

    def report(self, per: float, requests: int) -> dict[str, Any]:
        """Every figure divided by `per`; `requests` is how many submissions the totals hold."""
        scale = 1.0 / per if per else 1.0
        scaled = self.scaled(scale)
        sources = {s: {k: v * scale for k, v in row.items()} for s, row in self.by_source(requests).items()}
        return {"commands": _round({n: c for n, c in sorted(scaled.calls.items()) if abs(c) >= 1e-4}),
                "command_usec": _round({n: u for n, u in sorted(scaled.usec.items()) if abs(u) >= 1e-4}),
                "by_source": {s: _round(v) for s, v in sorted(sources.items())},
                "calls": round(sum(scaled.calls.values()), 4), "net_in_bytes": round(scaled.net_in, 1),
                "net_out_bytes": round(scaled.net_out, 1), "cpu_us": round(scaled.cpu_us, 2),
                "cpu_main_thread_us": round(scaled.cpu_main_us, 2)}


def _round(values: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 4) for k, v in values.items()}


async def streamed_tokens(session: aiohttp.ClientSession, url: str, model: str, prompt: str, max_tokens: int) -> int:
    """Generated tokens of one streamed completion (-1: it failed)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    tokens, done = 0, False
    try:
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            if resp.status != 200:
                await resp.read()
                return -1
            async for event in sse_payloads(resp.content):
                if event == SSE_DONE:
                    done = True
                elif "error" in event:
                    return -1
                elif event.get("usage"):
                    tokens = int(event["usage"]["completion_tokens"])
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return -1
    return tokens if done else -1


async def burst(urls: list[str], requests: int, concurrency: int, max_tokens: int) -> list[int]:
    """`requests` streamed completions, `concurrency` at a time, spread over the gateways."""
    limit = asyncio.Semaphore(concurrency)
    bar = tqdm(total=requests, desc="requests", unit="req", file=sys.stderr, leave=False)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        async def one(i: int) -> int:
            async with limit:
                tokens = await streamed_tokens(session, urls[i % len(urls)], MODEL, f"Redis cost request {i}",
                                               max_tokens)
            bar.update(1)
            return tokens

        results = await asyncio.gather(*(one(i) for i in range(requests)))
    bar.close()
    return list(results)


@dataclass(slots=True)
class Stack:
    """redis-server, engines and gateways of one measurement."""

    client: redis.Redis
    urls: list[str]
    procs: list[subprocess.Popen[bytes]]

    def stop(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def start_stack(redis_url: str, args: argparse.Namespace, model_dir: str, tok_s: float, workdir: Path) -> Stack:
    env = {"PAGEDSERVE_REDIS_URL": redis_url, "OMP_NUM_THREADS": "1"}
    if args.fake_engines:
        engines = [_start_module(["benchmarks.serving.fake_engine", "--redis-url", redis_url, "--model-name", MODEL,
                                  "--model-dir", model_dir, "--engines", str(args.fake_engines), "--tok-s", str(tok_s),
                                  "--max-num-seqs", str(args.max_num_seqs), "--id-prefix", f"fake{int(tok_s)}"],
                                 workdir / f"fake-{tok_s}.log", env)]
        count = args.fake_engines
    else:
        engines = [_start(["engine", "--model", model_dir, "--served-model-name", MODEL, "--engine-id", "cost-0",
                           "--kv-cache-memory", args.kv_cache_memory, "--max-num-seqs", str(args.max_num_seqs)],
                          workdir / "engine.log", env)]
        count = 1
    ports = [free_port() for _ in range(args.gateways)]
    gateways = [_start(["gateway", "--host", "127.0.0.1", "--port", str(port), "--gateway-id", f"cost-gw-{i}",
                        "--max-queued", str(max(4096, args.requests))], workdir / f"gateway-{i}-{tok_s}.log", env)
                for i, port in enumerate(ports)]
    stack = Stack(redis.Redis.from_url(redis_url), [f"http://127.0.0.1:{p}" for p in ports], [*gateways, *engines])
    deadline = time.monotonic() + args.ready_timeout
    engines_key = Keys().engines
    while not all(_healthy(u) for u in stack.urls) or int(stack.client.zcard(engines_key)) < count:
        if time.monotonic() > deadline or any(p.poll() is not None for p in stack.procs):
            stack.stop()
            raise RuntimeError(f"stack not ready; logs in {workdir}")
        time.sleep(0.5)
    return stack


def _start_module(argv: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """`python -m argv...` from the repository root (`_start` runs the `pagedserve` command)."""
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, "-m", *argv], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, **env})


def measure(args: argparse.Namespace, model_dir: str, tok_s: float, workdir: Path) -> list[dict[str, Any]]:
    """One stack: its idle line and its burst line."""
    mode = {"engines": "fake" if args.fake_engines else "real", "engine_count": args.fake_engines or 1,
            "engine_tok_s": tok_s if args.fake_engines else None, "gateways": args.gateways}
    with RedisServer() as server:
        stack = start_stack(server.url, args, model_dir, tok_s, workdir)
        try:
            time.sleep(args.settle_s)  # start-up writes (groups, first heartbeats) out of the idle figure
            before = Counters.read(stack.client)
            time.sleep(args.idle_s)
            after = Counters.read(stack.client)
            idle = Cost.between(before, after).scaled(1.0 / (after.at - before.at))
            start = Counters.read(stack.client)
            results = asyncio.run(burst(stack.urls, args.requests, args.concurrency, args.max_tokens))
            end = Counters.read(stack.client)
        finally:
            stack.stop()
    duration = end.at - start.at
    raw = Cost.between(start, end)
    net = raw.minus(idle.scaled(duration))  # the background of the burst's duration taken off
    ok = [t for t in results if t >= 0]
    tokens = sum(ok)
    idle_line = {"phase": "idle", **mode, "seconds": round(after.at - before.at, 2), "per_s": idle.report(1.0, 0)}
    burst_line = {"phase": "burst", **mode, "requests": args.requests, "completed": len(ok),
                  "failed": len(results) - len(ok), "max_tokens": args.max_tokens, "concurrency": args.concurrency,
                  "tokens": tokens, "duration_s": round(duration, 3), "tok_s": round(tokens / duration, 1),
                  "redis_cpu_share": round(raw.cpu_us / 1e6 / duration, 4),
                  "redis_main_thread_share": round(raw.cpu_main_us / 1e6 / duration, 4),
                  "per_request": net.report(len(ok), len(ok)) if ok else None,
                  "per_token": net.report(tokens, len(ok)) if tokens else None,
                  "saturation_tok_s": round(1e6 * tokens / net.cpu_main_us) if tokens and net.cpu_main_us > 0 else None}
    if args.fake_engines and tokens and net.cpu_main_us > 0:
        burst_line["engines_per_master"] = round(1e6 * tokens / net.cpu_main_us / tok_s, 1)
    return [idle_line, burst_line]


def _model_dir(args: argparse.Namespace, workdir: Path) -> str:
    if args.model:
        return str(args.model)
    from tests.fixtures.models import make_tiny_model_dir

    return str(make_tiny_model_dir(workdir / "tiny-model"))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None,
                        help="model directory (default: a tiny random model with a byte tokenizer)")
    parser.add_argument("--fake-engines", type=int, default=0, help="N fake engines instead of one real one")
    parser.add_argument("--engine-tok-s", default="1000",
                        help="with --fake-engines: tokens a second per engine, comma-separated for several runs")
    parser.add_argument("--gateways", type=int, default=1)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=64, help="streams open at once")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--kv-cache-memory", default="64MiB")
    parser.add_argument("--idle-s", type=float, default=5.0, help="idle measurement (background cost per second)")
    parser.add_argument("--settle-s", type=float, default=2.0, help="wait after start-up before measuring")
    parser.add_argument("--ready-timeout", type=float, default=300.0)
    args = parser.parse_args(argv)
    speeds = [float(s) for s in args.engine_tok_s.split(",")] if args.fake_engines else [0.0]
    with tempfile.TemporaryDirectory(prefix="redis-cost-") as tmp:
        workdir = Path(tmp)
        model_dir = _model_dir(args, workdir)
        for tok_s in speeds:
            for line in measure(args, model_dir, tok_s, workdir):
                print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
