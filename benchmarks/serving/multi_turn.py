"""Multi-turn chat on a fleet: cache-aware routing on against off, in one run.

Starts one Redis, `--engines` engine processes (each with its own prefix cache) and one gateway
per mode (`--routing off`, `--routing on`), then for each mode runs `--conversations` concurrent
chats of `--turns` turns, each with its own system prompt (distinct per mode too, so no mode finds
the other's history cached). Every turn resends the whole history; `--think-time` spaces a
conversation's turns as a reader would (the same pauses in every mode and round). JSON lines on stdout, one per
mode and round (`--rounds`, modes alternating), each round's comparison, then the rounds at a glance:

- `cached_share`: of the resent history that can be cached (the previous turn's prompt, whole
  blocks), the share the engines reported cached (`usage.prompt_tokens_details.cached_tokens`);
  random placement over two engines finds about half of it;
- `ttft_p50_s` / `ttft_p99_s` of the later turns (2..N), the first turns' apart;
- `output_tok_s` over the mode's wall time, and per engine the prompt tokens it admitted
  (both engines busy);
- `routed`: the mode's gateway's routing decisions (`prefix`, `load`, `shared`) and the requests
  the engines stole from each other during the mode (`stolen`), which tell a low share's cause.

    python benchmarks/serving/multi_turn.py                      # SmolLM2, 2 engines, 8 x 4 turns
    python benchmarks/serving/multi_turn.py --model TINY_DIR --conversations 4 --turns 3
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from common.ports import free_port  # noqa: E402
from pagedserve.launch.redis_server import RedisServer  # noqa: E402

WORDS = ("kernel", "block", "cache", "paged", "request", "engine", "stream", "token", "batch", "prefix", "memory",
         "window", "gateway", "schedule", "preempt", "swap", "recompute", "decode", "prefill", "sampler", "logits",
         "vector", "tensor", "queue", "shard", "replica", "sentinel", "master", "heartbeat", "budget", "latency")
TOPICS = ("rivers", "compilers", "gardens", "bridges", "volcanoes", "chess", "bread", "satellites")


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "pagedserve.cli", *args]


def system_prompt(rng: random.Random, words: int) -> str:
    """A distinct system prompt of `words` pseudo-random words."""
    return "You are a helpful assistant. Context: " + " ".join(rng.choice(WORDS) for _ in range(words)) + "."


def _get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return str(resp.read().decode())


def _wait(check: Any, what: str, timeout: float, procs: list[subprocess.Popen[bytes]]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError(f"a process exited while waiting for {what}")
        with contextlib.suppress(OSError, ValueError):
            if check():
                return
        time.sleep(0.5)
    raise RuntimeError(f"{what} not ready within {timeout:.0f}s")


def metric(text: str, name: str) -> float:
    """The sum of a Prometheus metric's samples in an exposition text."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#") and line[len(name)] in " {")


@contextlib.contextmanager
def fleet(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    """Redis, the engines and one gateway per mode; yields their URLs once every gateway sees
    every engine."""
    redis = RedisServer().start()
    env = {**os.environ, "PAGEDSERVE_REDIS_URL": redis.url, "OMP_NUM_THREADS": str(args.threads)}
    procs: list[subprocess.Popen[bytes]] = []
    try:
        engines = []
        for i in range(args.engines):
            port = free_port()
            procs.append(subprocess.Popen(
                _cli("engine", "--model", args.model, "--engine-id", f"bench-engine-{i}", "--served-model-name",
                     "bench", "--kv-cache-memory", args.kv_cache_memory, "--metrics-port", str(port),
                     *args.engine_args.split()),
                cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            engines.append(f"http://127.0.0.1:{port}/metrics")
        gateways = {}
        for mode in args.modes:
            port = free_port()
            procs.append(subprocess.Popen(_cli("gateway", "--port", str(port), "--routing", mode), cwd=ROOT, env=env,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            gateways[mode] = f"http://127.0.0.1:{port}"
        for url in gateways.values():
            _wait(lambda u=url: json.loads(_get(f"{u}/health")).get("engines") == args.engines, f"{url}/health",
                  args.ready_timeout, procs)
        yield {"gateways": gateways, "engine_metrics": engines}
    finally:
        for proc in reversed(procs):
            proc.terminate()
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(30)
            if proc.poll() is None:
                proc.kill()
        redis.stop()


async def turn(session: Any, url: str, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    """One streamed chat turn: its text, TTFT and usage."""
    body = {"model": "bench", "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first: float | None = None
    text: list[str] = []
    usage: dict[str, Any] = {}
    async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            return {"error": f"{resp.status}: {(await resp.text())[:200]}"}
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("error"):
                return {"error": str(chunk["error"])[:200]}
            for choice in chunk.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    first = first if first is not None else time.perf_counter() - start
                    text.append(piece)
            usage = chunk.get("usage") or usage
    return {"text": "".join(text), "ttft_s": first if first is not None else time.perf_counter() - start,
            "prompt_tokens": usage.get("prompt_tokens", 0), "completion_tokens": usage.get("completion_tokens", 0),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)}


async def conversation(session: Any, url: str, c: int, args: argparse.Namespace, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed * 1000 + c)
    think = random.Random(c)  # the same pauses in every mode and round
    messages = [{"role": "system", "content": system_prompt(rng, args.system_words)}]
    turns = []
    for t in range(args.turns):
        messages.append({"role": "user", "content": f"Question {t + 1}: tell me one fact about "
                                                    f"{TOPICS[(c + t) % len(TOPICS)]}."})
        result = await turn(session, url, messages, args.max_tokens) | {"turn": t}
        turns.append(result)
        if "error" in result:
            break
        messages.append({"role": "assistant", "content": result["text"]})
        if args.think_time > 0 and t + 1 < args.turns:  # the user reads the answer before the next turn
            await asyncio.sleep(think.uniform(0.0, 2.0 * args.think_time))
    return turns


async def run_mode(url: str, args: argparse.Namespace, seed: int) -> tuple[list[list[dict[str, Any]]], float]:
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=args.request_timeout)) as session:
        start = time.perf_counter()
        convs = await asyncio.gather(*(conversation(session, url, c, args, seed) for c in range(args.conversations)))
        return list(convs), time.perf_counter() - start


def _pct(values: list[float], q: int) -> float:
    return round(statistics.quantiles(values, n=100, method="inclusive")[q - 1], 4) if len(values) > 1 else (
        round(values[0], 4) if values else 0.0)


ROUTING_METRICS = {"prefix": "pagedserve_gateway_routed_by_prefix_total",
                   "load": "pagedserve_gateway_routed_by_load_total",
                   "shared": "pagedserve_gateway_routed_shared_total", "stolen": "pagedserve_engine_stolen_total"}


def routing_counts(gateway: str) -> dict[str, float]:
    """A gateway's routing decisions so far and the engines' stolen requests (as its metrics say)."""
    text = _get(f"{gateway}/metrics")
    return {name: metric(text, series) for name, series in ROUTING_METRICS.items()}


def summarize(mode: str, convs: list[list[dict[str, Any]]], seconds: float, block_size: int,
              engine_prompt_tokens: list[float], routed: dict[str, float]) -> dict[str, Any]:
    """The mode's figures: cached share of the resent cacheable history, TTFTs, throughput."""
    cacheable = cached = 0
    later, first = [], []
    failed = sum(1 for conv in convs for t in conv if "error" in t)
    for conv in convs:
        for prev, cur in itertools.pairwise(conv):
            if "error" in cur or "error" in prev:
                continue
            history = prev["prompt_tokens"] // block_size * block_size
            cacheable += history
            cached += min(cur["cached_tokens"], history)
        first += [t["ttft_s"] for t in conv[:1] if "error" not in t]
        later += [t["ttft_s"] for t in conv[1:] if "error" not in t]
    tokens = sum(t.get("completion_tokens", 0) for conv in convs for t in conv)
    return {"mode": f"routing_{mode}", "conversations": len(convs), "failed": failed,
            "cached_share": round(cached / cacheable, 4) if cacheable else 0.0, "cacheable_tokens": cacheable,
            "ttft_p50_s": _pct(later, 50), "ttft_p99_s": _pct(later, 99), "first_turn_ttft_p50_s": _pct(first, 50),
            "output_tok_s": round(tokens / seconds, 2), "seconds": round(seconds, 2),
            "engine_prompt_tokens": [int(x) for x in engine_prompt_tokens],
            "routed": {name: int(count) for name, count in routed.items()}}


def run_measured(urls: dict[str, Any], mode: str, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """One mode's conversations through its gateway, summarized with the engines' prompt tokens
    and the routing decisions it made."""
    gateway = urls["gateways"][mode]
    before = [metric(_get(u), "pagedserve_prompt_tokens_total") for u in urls["engine_metrics"]]
    routed_before = routing_counts(gateway)
    convs, seconds = asyncio.run(run_mode(gateway, args, seed))
    time.sleep(2.5)  # a heartbeat after the last request, for the engines' `stolen`
    after = [metric(_get(u), "pagedserve_prompt_tokens_total") for u in urls["engine_metrics"]]
    routed = {name: count - routed_before[name] for name, count in routing_counts(gateway).items()}
    return summarize(mode, convs, seconds, args.block_size, [b - a for a, b in zip(before, after, strict=True)],
                     routed)


def compare(on: dict[str, Any], off: dict[str, Any]) -> dict[str, Any]:
    """One round's routing-on figures against routing-off's (ratios on / off)."""

    def ratio(key: str) -> float | None:
        return round(on[key] / off[key], 3) if off[key] else None

    return {"bench": "routing_on_vs_off", "cached_share_on": on["cached_share"],
            "cached_share_off": off["cached_share"],
            "ttft_p50_ratio": ratio("ttft_p50_s"), "ttft_p99_ratio": ratio("ttft_p99_s"),
            "output_tok_s_ratio": ratio("output_tok_s"), "failed": on["failed"] + off["failed"]}


def overall(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The rounds at a glance: medians and how many rounds met the issue's goal (a cached share
    of at least 0.90 and a lower later-turn TTFT p50 with routing)."""
    met = sum(1 for r in rounds if r["cached_share_on"] >= 0.90 and (r["ttft_p50_ratio"] or 2.0) < 1.0)
    return {"bench": "routing_rounds", "rounds": len(rounds), "rounds_meeting_goal": met,
            "cached_share_on_median": statistics.median(r["cached_share_on"] for r in rounds),
            "cached_share_off_median": statistics.median(r["cached_share_off"] for r in rounds),
            "ttft_p50_ratio_median": statistics.median(r["ttft_p50_ratio"] or 0.0 for r in rounds),
            "ttft_p99_ratio_median": statistics.median(r["ttft_p99_ratio"] or 0.0 for r in rounds),
            "output_tok_s_ratio_median": statistics.median(r["output_tok_s_ratio"] or 0.0 for r in rounds),
            "failed": sum(r["failed"] for r in rounds)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model directory or .gguf (default: SmolLM2-135M-Instruct's, as `up`)")
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-words", type=int, default=160, help="words of each distinct system prompt")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--think-time", type=float, default=0.0,
                        help="mean seconds a user waits after an answer before the next turn (uniform on [0, 2x]); "
                             "0: at once, every conversation's turns in lockstep")
    parser.add_argument("--kv-cache-memory", default="256MiB")
    parser.add_argument("--threads", type=int, default=1, help="OMP threads per engine")
    parser.add_argument("--block-size", type=int, default=16, help="the engines' block size (whole cacheable blocks)")
    parser.add_argument("--modes", default="off,on", help="gateway --routing values, run in this order")
    parser.add_argument("--rounds", type=int, default=3,
                        help="run the modes this many times, alternating (fresh system prompts each time)")
    parser.add_argument("--engine-args", default="", help="extra `pagedserve engine` arguments")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ready-timeout", type=float, default=600.0)
    parser.add_argument("--request-timeout", type=float, default=600.0)
    args = parser.parse_args()
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if args.model is None:
        from engine.worker.cli import resolve_model

        args.model, _ = resolve_model(None)
    print(json.dumps({"bench": "setup", "model": str(args.model), "engines": args.engines,
                      "conversations": args.conversations, "turns": args.turns, "modes": args.modes}), flush=True)
    comparisons = []
    with fleet(args) as urls:
        for rnd in range(args.rounds):
            rows = {}
            for k, mode in enumerate(args.modes):
                rows[mode] = run_measured(urls, mode, args, args.seed + 1 + k + len(args.modes) * rnd) | {"round": rnd}
                print(json.dumps(rows[mode]), flush=True)
            if {"on", "off"} <= set(rows):
                comparisons.append(compare(rows["on"], rows["off"]) | {"round": rnd})
                print(json.dumps(comparisons[-1]), flush=True)
    if comparisons:
        print(json.dumps(overall(comparisons)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
