"""Gateway metrics in a per-app CollectorRegistry (Prometheus text on GET /metrics)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from common.redis_conn import MeteredPool
from gateway.broker.router import REASONS, Router

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
_POOL_WAIT_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 20.0)


class _PoolCollector(Collector):
    """The Redis connection pool as gauges: connections in use, callers waiting, limits."""

    def __init__(self, pool: MeteredPool, wait: Histogram) -> None:
        self.pool = pool
        self.wait = wait

    def collect(self) -> Iterator[Metric]:
        pool, figures = self.pool, self.pool.figures
        waits, figures.waits = figures.waits, []
        for seconds in waits:
            self.wait.observe(seconds)
        yield GaugeMetricFamily("pagedserve_redis_pool_in_use", "Redis connections in use", value=pool.in_use)
        yield GaugeMetricFamily("pagedserve_redis_pool_waiting", "callers waiting for a Redis connection",
                                value=figures.waiting)
        yield GaugeMetricFamily("pagedserve_redis_pool_max", "Redis connection pool size",
                                value=pool.max_connections)
        yield CounterMetricFamily("pagedserve_redis_pool_timeouts", "waits for a connection that timed out",
                                  value=figures.timeouts)
        yield GaugeMetricFamily("pagedserve_redis_pool_max_wait_seconds", "longest wait for a connection so far",
                                value=figures.max_wait_seconds)


class _RouterCollector(Collector):
    """Routing decisions of this gateway by reason, and per engine (as its last heartbeat says)
    its prefix-cache hit rate (tokens found cached / prompt tokens looked up) and requests stolen."""

    def __init__(self, router: Router) -> None:
        self.router = router

    def collect(self) -> Iterator[Metric]:
        for reason in REASONS:
            yield CounterMetricFamily(f"pagedserve_gateway_routed_{'by_' if reason != 'shared' else ''}{reason}",
                                      f"requests routed ({reason})", value=self.router.counts[reason])
        hits = GaugeMetricFamily("pagedserve_engine_prefix_hit_rate",
                                 "prefix-cache tokens hit / looked up, per engine (heartbeat)",
                                 labels=["model", "engine"])
        stolen = CounterMetricFamily("pagedserve_engine_stolen", "requests an engine took from a peer's "
                                     "routed stream (heartbeat)", labels=["model", "engine"])
        for beat in self.router.beats:
            queries = beat.stats.get("prefix_queries", 0.0)
            hits.add_metric([beat.model, beat.engine_id], beat.stats.get("prefix_hits", 0.0) / queries
                            if queries else 0.0)
            if "stolen" in beat.stats:
                stolen.add_metric([beat.model, beat.engine_id], beat.stats["stolen"])
        yield hits
        yield stolen


class GatewayMetrics:
    """Request counts and client-visible latencies, as seen by this gateway."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.http_requests = Counter("pagedserve_gateway_http_requests", "HTTP requests by route and status",
                                     ["route", "status"], registry=r)
        self.in_flight = Gauge("pagedserve_gateway_requests_in_flight", "generation requests in progress",
                               registry=r)
        self.rejected = Counter("pagedserve_gateway_rejected", "requests refused before submission, by reason",
                                ["reason"], registry=r)
        self.rate_limited = Counter("pagedserve_gateway_rate_limited", "requests refused with 429 by the "
                                    "per-API-key rate limits, by exhausted budget", ["type"], registry=r)
        self.success = Counter("pagedserve_request_success", "finished requests by finish reason",
                               ["finished_reason"], registry=r)
        self.served = Counter("pagedserve_gateway_served_requests", "finished requests by model and by the "
                              "engine that finished them (its id, as its output messages name it)",
                              ["model", "engine"], registry=r)
        self.prompt_tokens = Counter("pagedserve_prompt_tokens", "prompt tokens submitted", registry=r)
        self.generation_tokens = Counter("pagedserve_generation_tokens", "tokens generated", registry=r)
        self.ttft = Histogram("pagedserve_time_to_first_token_seconds", "time to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("pagedserve_time_per_output_token_seconds", "time per output token after the first",
                              buckets=_TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("pagedserve_e2e_request_latency_seconds", "request latency end to end",
                             buckets=_LATENCY_BUCKETS, registry=r)

    def watch_pool(self, pool: MeteredPool) -> None:
        """Export the Redis pool's use; the wait histogram fills at each scrape."""
        wait = Histogram("pagedserve_redis_pool_wait_seconds", "time to get a Redis connection",
                         buckets=_POOL_WAIT_BUCKETS, registry=None)
        self.registry.register(_PoolCollector(pool, wait))
        self.registry.register(wait)

    def watch_router(self, router: Router) -> None:
        """Export routing counters (routed_by_prefix, routed_by_load, routed_shared) and the
        engines' hit rates."""
        self.registry.register(_RouterCollector(router))

    def observe_request(self, finish_reasons: list[str], prompt_tokens: int, completion_tokens: int,
                        start: float, first_token: float | None, end: float) -> None:
        for reason in finish_reasons:
            self.success.labels(finished_reason=reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        self.e2e.observe(end - start)
        if first_token is not None:
            self.ttft.observe(first_token - start)
            if completion_tokens > 1:
                self.tpot.observe((end - first_token) / (completion_tokens - 1))

    def observe_served(self, model: str, engine: str | None) -> None:
        """A finished request, counted for the engine serving it at the end (the last that named
        itself on its output; from an engine too old to name itself: not counted)."""
        if engine is not None:
            self.served.labels(model=model, engine=engine).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
