"""Engine metrics: every name of DESIGN.md, values taken from the engine's stats."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from engine.worker.heartbeat import flatten_stats
from engine.worker.metrics import EngineMetrics

STATS = {
    "num_blocks": 100, "num_free_blocks": 60, "usage_ratio": 0.4, "block_utilization": 0.75,
    "num_cpu_blocks": 50, "num_free_cpu_blocks": 45, "running": 3, "waiting": 2, "swapped": 1,
    "preemptions": {"recompute": 4}, "cow_copies": 7, "prefix_queries": 20, "prefix_hits": 5,
    "prompt_tokens": 300, "generation_tokens": 120, "finished": {"stop": 9, "length": 2, "abort": 1},
}


def _samples(metrics: EngineMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(metrics.render().decode()) for s in family.samples}


def test_metric_names_and_values() -> None:
    metrics = EngineMetrics("cuda")
    assert not any(name.startswith("pagedserve_kv") for name, _ in _samples(metrics))  # nothing before a step
    metrics.update(STATS)
    metrics.observe_finished(arrival=100.0, first_token=100.5, end=102.5, num_tokens=5)
    s = _samples(metrics)
    assert s[("pagedserve_kv_blocks_total", (("device", "cuda"),))] == 100
    assert s[("pagedserve_kv_blocks_total", (("device", "host"),))] == 50
    assert s[("pagedserve_kv_blocks_free", (("device", "cuda"),))] == 60
    assert s[("pagedserve_kv_cache_usage_ratio", (("device", "cuda"),))] == 0.4
    assert s[("pagedserve_kv_cache_usage_ratio", (("device", "host"),))] == 0.1
    assert s[("pagedserve_kv_block_utilization_ratio", ())] == 0.75
    assert (s[("pagedserve_requests_running", ())], s[("pagedserve_requests_waiting", ())],
            s[("pagedserve_requests_swapped", ())]) == (3, 2, 1)
    assert s[("pagedserve_preemptions_total", (("mode", "recompute"),))] == 4
    assert s[("pagedserve_preemptions_total", (("mode", "swap"),))] == 0
    assert s[("pagedserve_cow_copies_total", ())] == 7
    assert s[("pagedserve_prefix_cache_queries_total", ())] == 20
    assert s[("pagedserve_prefix_cache_hits_total", ())] == 5
    assert s[("pagedserve_prompt_tokens_total", ())] == 300
    assert s[("pagedserve_generation_tokens_total", ())] == 120
    assert s[("pagedserve_request_success_total", (("finished_reason", "stop"),))] == 9
    assert s[("pagedserve_time_to_first_token_seconds_sum", ())] == 0.5
    assert s[("pagedserve_time_per_output_token_seconds_sum", ())] == 0.5
    assert s[("pagedserve_e2e_request_latency_seconds_count", ())] == 1


def test_heartbeat_stats_are_flat_numbers() -> None:
    flat = flatten_stats(STATS)
    assert flat["preemptions_recompute"] == 4.0 and flat["finished_abort"] == 1.0
    assert all(isinstance(v, float) for v in flat.values())
