"""Each server's own figures, read over its HTTP port: tokens its engine generated so far and
requests still in flight. peer_bench waits for a server to be idle before a run (a request the
gateway gave up on may still be decoding) and reports a served output rate that depends neither
on the client parsing every stream nor on requests finishing.

- vLLM: its Prometheus page (`/metrics`): `vllm:generation_tokens_total`,
  `vllm:num_requests_running`, `vllm:num_requests_waiting`.
- pagedserve: the engine figures the gateway relays from heartbeats (`GET /v1/engines/stream`):
  `generation_tokens`, `running`, `waiting`, `swapped` (the gateway's own `/metrics` counts only
  requests that finished)."""

from __future__ import annotations

import time
import urllib.request
from typing import Any

from gateway.clients.sse_reader import sse_data


def metric_value(text: str, name: str) -> float:
    """The sum over label sets of metric `name` in a Prometheus text page."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name):len(name) + 1] in (" ", "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def vllm_figures(base_url: str, since: float) -> tuple[float, float]:
    """(generated tokens, requests in flight); vLLM's page is current, so `since` is not needed."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    in_flight = metric_value(text, "vllm:num_requests_running") + metric_value(text, "vllm:num_requests_waiting")
    return metric_value(text, "vllm:generation_tokens_total"), in_flight


def heartbeat_figures(event: dict[str, Any]) -> tuple[float, float, float]:
    """(generated tokens, requests in flight, oldest heartbeat time) of one engines-stream event,
    summed over engines."""
    engines = event.get("engines") or []
    stats = [e["stats"] for e in engines]
    tokens = sum(float(s.get("generation_tokens", 0)) for s in stats)
    in_flight = sum(float(s.get(k, 0)) for s in stats for k in ("running", "waiting", "swapped"))
    return tokens, in_flight, min((float(e["time"]) for e in engines), default=0.0)


def pagedserve_figures(base_url: str, since: float, timeout: float = 60.0) -> tuple[float, float]:
    """(generated tokens, requests in flight) from heartbeats all newer than `since` (time.time())."""
    deadline = time.monotonic() + timeout
    with urllib.request.urlopen(f"{base_url}/v1/engines/stream?interval=0.25", timeout=timeout) as resp:
        for raw in resp:
            event = sse_data(raw)
            if not isinstance(event, dict):
                continue
            tokens, in_flight, oldest = heartbeat_figures(event)
            if oldest > since:
                return tokens, in_flight
            if time.monotonic() > deadline:
                break
    raise RuntimeError(f"no engine heartbeat newer than the run from {base_url} within {timeout:.0f}s")
