"""Each server's own count of the tokens its engine generated, read over its HTTP port, so that
peer_bench can report a served output rate that does not depend on the client parsing every
stream, nor on requests finishing (a request the gateway times out still cost its tokens).

- vLLM: the `vllm:generation_tokens_total` counter of its Prometheus page (`/metrics`).
- pagedserve: `generation_tokens` in the engine figures the gateway relays from heartbeats
  (`GET /v1/engines/stream`); the gateway's own `/metrics` counts only requests that finished."""

from __future__ import annotations

import json
import time
import urllib.request


def counter_value(text: str, name: str) -> float:
    """The sum over label sets of Prometheus counter `name` in a text exposition page."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name):len(name) + 1] in (" ", "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def prometheus_tokens(base_url: str, name: str = "vllm:generation_tokens_total") -> float:
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=10) as resp:
        return counter_value(resp.read().decode(), name)


def heartbeat_tokens(event: dict[str, object]) -> tuple[float, float]:
    """(generated tokens summed over engines, oldest heartbeat time) of one engines-stream event."""
    engines = event.get("engines") or []
    assert isinstance(engines, list)
    tokens = sum(float(e["stats"].get("generation_tokens", 0)) for e in engines)
    oldest = min((float(e["time"]) for e in engines), default=0.0)
    return tokens, oldest


def pagedserve_tokens(base_url: str, since: float, timeout: float = 60.0) -> float:
    """Engine-side generated tokens from heartbeats all newer than `since` (a time.time() stamp)."""
    deadline = time.monotonic() + timeout
    with urllib.request.urlopen(f"{base_url}/v1/engines/stream?interval=0.25", timeout=timeout) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            tokens, oldest = heartbeat_tokens(json.loads(line.removeprefix("data: ")))
            if oldest > since:
                return tokens
            if time.monotonic() > deadline:
                break
    raise RuntimeError(f"no engine heartbeat newer than the run from {base_url} within {timeout:.0f}s")
