"""Multi-turn conversations through a two-engine fleet, cache-aware routing on vs off in one run:
one redis-server, engine processes (routed streams announced), one gateway process with
``--routing on`` and one with ``--routing off``. Each phase runs its own conversations (distinct
system prompts, so the second phase inherits no cache from the first), all at once, each turn
resending the whole history. Prints one JSON line per phase: the cached share of resent history
(prompt tokens found cached / tokens resent from earlier turns), TTFT p50/p99 of turns after the
first, output tokens per second, and requests each engine stole.

    python benchmarks/fleet/multi_turn.py --model DIR --conversations 8 --turns 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import redis

from common.ports import free_port
from common.protocol import EngineHeartbeat, Keys
from gateway.clients.sse_reader import SSE_DONE, sse_payloads
from pagedserve.launch.redis_server import RedisServer

ROOT = Path(__file__).resolve().parents[2]
MODEL = "bench"
WORDS = ["apple", "river", "stone", "cloud", "maple", "tiger", "lemon", "violet", "copper", "desert", "harbor",
         "meadow"]


def _start(args: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, "-m", "pagedserve.cli", *args], cwd=ROOT, stdout=out,
                                stderr=subprocess.STDOUT, env={**os.environ, **env})


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


def _beats(redis_url: str, ids: list[str]) -> list[EngineHeartbeat | None]:
    with redis.Redis.from_url(redis_url) as client:
        raws = [client.hgetall(Keys().engine(engine_id)) for engine_id in ids]
    return [EngineHeartbeat.from_hash(raw) if raw else None for raw in raws]


def system_prompt(phase: str, i: int, words: int) -> str:
    """A distinct opening per phase and conversation."""
    return f"[{phase}] System {i}: " + " ".join(WORDS[(i * 5 + k * 7) % len(WORDS)] for k in range(words)) + "\n"


async def _turn(session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    """One streamed greedy completion: text, usage, time to first token."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    text, usage, ttft = "", None, None
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {await resp.text()}")
        async for event in sse_payloads(resp.content):
            if event == SSE_DONE:
                break
            if "error" in event:
                raise RuntimeError(f"stream error: {event['error']}")
            for choice in event.get("choices") or []:
                if choice.get("text") and ttft is None:
                    ttft = time.perf_counter() - start
                text += choice.get("text", "")
            if event.get("usage"):
                usage = event["usage"]
    assert usage is not None, "no usage in the stream"
    return {"text": text, "usage": usage, "ttft": ttft if ttft is not None else time.perf_counter() - start}


async def _conversation(session: aiohttp.ClientSession, url: str, opening: str, turns: int, max_tokens: int,
                        out: list[dict[str, Any]]) -> None:
    history, resent = opening, 0
    for turn in range(turns):
        reply = await _turn(session, url, history, max_tokens)
        out.append(reply | {"turn": turn, "resent": resent})
        resent = reply["usage"]["prompt_tokens"] + reply["usage"]["completion_tokens"]
        history += reply["text"] + f"\nUser turn {turn}: tell me more about that.\n"


async def phase(url: str, name: str, args: argparse.Namespace) -> dict[str, Any]:
    results: list[dict[str, Any]] = []
    timeout = aiohttp.ClientTimeout(total=1800)
    start = time.perf_counter()
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(_conversation(session, url, system_prompt(name, i, args.system_words), args.turns,
                                             args.max_tokens, results) for i in range(args.conversations)))
    duration = time.perf_counter() - start
    later = [r for r in results if r["turn"] > 0]
    ttfts = sorted(r["ttft"] for r in later)
    q = statistics.quantiles(ttfts, n=100) if len(ttfts) >= 2 else [ttfts[0] if ttfts else 0.0] * 99
    cached = sum(r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in later)
    resent = sum(r["resent"] for r in later)
    return {"routing": name, "conversations": args.conversations, "turns": args.turns,
            "cached_share_of_resent": round(cached / resent, 3) if resent else 0.0,
            "ttft_later_p50_s": round(q[49], 4), "ttft_later_p99_s": round(q[98], 4),
            "output_tok_s": round(sum(r["usage"]["completion_tokens"] for r in results) / duration, 1),
            "duration_s": round(duration, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="model directory (a tiny random one works)")
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--system-words", type=int, default=60, help="words of each distinct system prompt")
    parser.add_argument("--kv-cache-memory", default="64MiB")
    parser.add_argument("--phases", default="on,off", help="gateway --routing values, run one after the other")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="multi-turn-") as tmp, RedisServer() as server:
        workdir, env = Path(tmp), {"PAGEDSERVE_REDIS_URL": server.url}
        ids = [f"mt-{i}" for i in range(args.engines)]
        procs = [_start(["engine", "--model", args.model, "--served-model-name", MODEL, "--engine-id", engine_id,
                         "--kv-cache-memory", args.kv_cache_memory], workdir / f"{engine_id}.log", env)
                 for engine_id in ids]
        try:
            deadline = time.monotonic() + 300
            while not all(b is not None and b.routed for b in _beats(server.url, ids)):
                if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                    raise RuntimeError(f"engines not ready; logs in {workdir}")
                time.sleep(0.5)
            for name in args.phases.split(","):
                port = free_port()
                gateway = _start(["gateway", "--host", "127.0.0.1", "--port", str(port), "--routing", name],
                                 workdir / f"gateway-{name}.log", env)
                procs.append(gateway)
                url = f"http://127.0.0.1:{port}"
                while not _healthy(url):
                    if time.monotonic() > deadline + 120 or gateway.poll() is not None:
                        raise RuntimeError(f"gateway not healthy; logs in {workdir}")
                    time.sleep(0.3)
                result = asyncio.run(phase(url, name, args))
                beats = _beats(server.url, ids)
                result["stolen"] = {engine_id: beat.stats.get("stolen", 0.0) if beat else None
                                    for engine_id, beat in zip(ids, beats, strict=True)}
                print(json.dumps(result), flush=True)
                gateway.terminate()
                gateway.wait(30)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.terminate()
            for proc in procs:
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()


if __name__ == "__main__":
    main()
