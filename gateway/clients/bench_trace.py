"""Benchmark workloads: a JSONL trace or a synthetic one. Torch-free, numpy-free.

A trace line is a JSON object with either `prompt` (text) or `prompt_len` (tokens, as the
simulator's traces have; the prompt is made of that many words), plus `max_tokens` or
`output_len`, and optionally `n`. Arrival times in the trace are ignored: the benchmark
draws its own Poisson arrivals at the requested rate."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

_WORDS = ["paged", "attention", "keeps", "the", "kv", "cache", "in", "fixed", "size", "blocks", "so",
          "memory", "is", "never", "wasted", "and", "many", "requests", "share", "one", "device"]


@dataclass(frozen=True, slots=True)
class BenchRequest:
    prompt: str
    max_tokens: int
    n: int = 1


def _words(count: int, rng: random.Random) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(max(1, count)))


def load_trace(path: Path, seed: int = 0) -> list[BenchRequest]:
    rng = random.Random(seed)
    requests = []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            prompt = obj["prompt"] if "prompt" in obj else _words(int(obj["prompt_len"]), rng)
            max_tokens = int(obj.get("max_tokens", obj.get("output_len", 64)))
            requests.append(BenchRequest(str(prompt), max_tokens, int(obj.get("n", 1))))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{lineno}: bad trace line ({exc!r})") from exc
    if not requests:
        raise ValueError(f"{path}: no requests")
    return requests


def synthetic(num: int, prompt_len: int, output_len: int, seed: int = 0) -> list[BenchRequest]:
    """`num` requests with lengths uniform in [len/2, 3*len/2]."""
    rng = random.Random(seed)
    return [BenchRequest(_words(rng.randint(max(1, prompt_len // 2), prompt_len * 3 // 2), rng),
                         rng.randint(max(1, output_len // 2), max(1, output_len * 3 // 2)))
            for _ in range(num)]


def poisson_arrivals(count: int, rate: float, seed: int = 0) -> list[float]:
    """Arrival offsets in seconds; all zero when `rate` is infinite."""
    if rate == float("inf"):
        return [0.0] * count
    rng = random.Random(seed)
    t, times = 0.0, []
    for _ in range(count):
        times.append(t)
        t += rng.expovariate(rate)
    return times
