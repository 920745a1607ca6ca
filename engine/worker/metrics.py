"""Engine metrics (Prometheus text) in the worker's own CollectorRegistry.

Block and queue figures are read from the latest `LLMEngine.stats()` snapshot when scraped;
latencies are histograms the worker observes as requests finish."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
HOST = "host"  # the `device` label of the swap pool in host memory


class _StatsCollector(Collector):
    """Turns the latest stats dict into gauges and counters."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.stats: dict[str, Any] = {}

    def collect(self) -> Iterator[Metric]:
        s = self.stats
        if not s:
            return
        yield self._pool("pagedserve_kv_blocks_total", "KV-cache blocks in the pool", "num_blocks", "num_cpu_blocks")
        yield self._pool("pagedserve_kv_blocks_free", "free KV-cache blocks", "num_free_blocks", "num_free_cpu_blocks")
        usage = GaugeMetricFamily("pagedserve_kv_cache_usage_ratio", "used / total blocks", labels=["device"])
        usage.add_metric([self.device], float(s["usage_ratio"]))
        cpu_total = s.get("num_cpu_blocks", 0)
        cpu_used = (cpu_total - s.get("num_free_cpu_blocks", 0)) / cpu_total if cpu_total else 0.0
        usage.add_metric([HOST], float(cpu_used))
        yield usage
        yield GaugeMetricFamily("pagedserve_kv_block_utilization_ratio",
                                "tokens stored / (used blocks x block size)", value=float(s["block_utilization"]))
        yield GaugeMetricFamily("pagedserve_tensor_parallel_size",
                                "ranks of this engine (the KV blocks above are the group's: every rank holds its "
                                "heads of each block)", value=float(s.get("tensor_parallel_size", 1)))
        for queue in ("running", "waiting", "swapped"):
            yield GaugeMetricFamily(f"pagedserve_requests_{queue}", f"requests {queue}", value=float(s[queue]))
        preempt = CounterMetricFamily("pagedserve_preemptions", "preemptions by mode", labels=["mode"])
        for mode in sorted(set(s.get("preemptions", {})) | {"recompute", "swap"}):
            preempt.add_metric([mode], float(s.get("preemptions", {}).get(mode, 0)))
        yield preempt
        for name, key, text in (("cow_copies", "cow_copies", "copy-on-write block copies"),
                                ("prefix_cache_queries", "prefix_queries", "prefix-cache lookups"),
                                ("prefix_cache_hits", "prefix_hits", "prefix-cache hits"),
                                ("prompt_tokens", "prompt_tokens", "prompt tokens admitted"),
                                ("generation_tokens", "generation_tokens", "tokens generated"),
                                ("dead_lettered", "dead_lettered", "request entries moved to the dead-letter stream"),
                                ("bad_abort_messages", "bad_aborts", "undecodable abort messages ignored"),
                                ("readopted_entries", "readopted",
                                 "own pending entries found untracked after Redis trouble, resumed or acknowledged"),
                                ("gateway_gone_aborted", "gateway_gone_aborted",
                                 "requests stopped: their gateway's liveness key stayed gone past --gateway-grace"),
                                ("gateway_restart_aborted", "gateway_restart_aborted",
                                 "requests stopped: their gateway restarted under the same id")):
            yield CounterMetricFamily(f"pagedserve_{name}", text, value=float(s.get(key, 0)))
        spec = s.get("spec") or {}
        method = str(s.get("spec_method") or "none")
        for name, key, text in (("spec_proposed_tokens", "proposed_tokens", "speculative tokens proposed"),
                                ("spec_accepted_tokens", "accepted_tokens", "speculative tokens accepted"),
                                ("spec_verified_rows", "verified_rows", "speculative rows verified")):
            counter = CounterMetricFamily(f"pagedserve_{name}", f"{text}, by method", labels=["method"])
            counter.add_metric([method], float(spec.get(key, 0)))
            yield counter
        success = CounterMetricFamily("pagedserve_request_success", "finished requests by reason",
                                      labels=["finished_reason"])
        for reason, count in sorted(s.get("finished", {}).items()):
            success.add_metric([str(reason)], float(count))
        yield success

    def _pool(self, name: str, text: str, device_key: str, host_key: str) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, text, labels=["device"])
        family.add_metric([self.device], float(self.stats.get(device_key, 0)))
        family.add_metric([HOST], float(self.stats.get(host_key, 0)))
        return family


class EngineMetrics:
    """Registry, stats collector and latency histograms of one engine worker."""

    def __init__(self, device: str) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self._stats = _StatsCollector(device)
        self.registry.register(self._stats)
        self.ttft = Histogram("pagedserve_time_to_first_token_seconds", "arrival to first token",
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.tpot = Histogram("pagedserve_time_per_output_token_seconds", "time per output token after the first",
                              buckets=TPOT_BUCKETS, registry=self.registry)
        self.e2e = Histogram("pagedserve_e2e_request_latency_seconds", "arrival to last token",
                             buckets=LATENCY_BUCKETS, registry=self.registry)

    def update(self, stats: dict[str, Any]) -> None:
        self._stats.stats = stats

    def observe_finished(self, arrival: float, first_token: float | None, end: float, num_tokens: int) -> None:
        """Latencies of a finished request (wall-clock seconds)."""
        self.e2e.observe(max(0.0, end - arrival))
        if first_token is not None:
            self.ttft.observe(max(0.0, first_token - arrival))
            if num_tokens > 1:
                self.tpot.observe(max(0.0, end - first_token) / (num_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)


async def start_metrics_server(metrics: EngineMetrics, host: str, port: int) -> web.AppRunner:
    """Serve GET /metrics on `host:port`; the caller cleans the runner up."""

    async def handle(_: web.Request) -> web.Response:
        return web.Response(body=metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/metrics", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
