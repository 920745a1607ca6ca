"""benchmarks/peer/peer_bench.py's own logic, without vLLM: option parsing, the figures read from a
`vllm bench serve` report and a Prometheus page, greedy agreement, and that stopping a server
kills descendants that left its process group."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from benchmarks.peer.cli import QUICK, parse_args
from benchmarks.peer.counters import heartbeat_figures, metric_value
from benchmarks.peer.offline import agreement
from benchmarks.peer.parts import _repeated, _throughput, served_ratios
from benchmarks.peer.served import _descendants, _stop_group, alive, pagedserve_spec, summarize


def test_only_keeps_documented_order_and_rejects_unknown_parts(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse_args(None, ["--only", "served,offline"]).only == ["offline", "served"]
    with pytest.raises(SystemExit):
        parse_args(None, ["--only", "offline,bogus"])
    assert "parts are offline,tiny,single,served" in capsys.readouterr().err


def test_quick_shrinks_defaults_but_explicit_sizes_win() -> None:
    full = parse_args(None, [])
    assert (full.num_requests, full.served_prompts, full.kv_cache_gib) == (128, 96, 2)
    quick = parse_args(None, ["--quick", "--served-prompts", "8"])
    assert quick.num_requests == QUICK["num_requests"] and quick.served_prompts == 8
    assert quick.kv_cache_gib == 2  # the pool is never scaled down


def test_summarize_reads_figures_and_groups_failure_causes() -> None:
    traceback = "Traceback (most recent call last):\n  File \"x\", line 1\nValueError: bad chunk\n"
    report = {"completed": 2, "failed": 3, "duration": 10.0, "output_throughput": 25.6, "median_ttft_ms": 1500.0,
              "p99_ttft_ms": 9000.0, "median_tpot_ms": 40.04,
              "errors": ["", "Never received a valid chunk", "Never received a valid chunk", traceback, ""]}
    figures = summarize(report)
    assert figures["ttft_p50_s"] == 1.5 and figures["ttft_p99_s"] == 9.0 and figures["output_tok_s"] == 25.6
    assert figures["failure_causes"] == {"Never received a valid chunk": 2, "ValueError: bad chunk": 1}


def test_metric_value_sums_label_sets_and_ignores_lookalikes() -> None:
    page = "\n".join([
        "# TYPE vllm:generation_tokens_total counter",
        'vllm:generation_tokens_total{engine="0",model_name="m"} 120.0',
        'vllm:generation_tokens_total{engine="1",model_name="m"} 8.0',
        "vllm:generation_tokens_created 1.7e9",
        'vllm:num_requests_waiting{engine="0"} 3.0',
        'vllm:num_requests_waiting_by_reason{reason="capacity"} 3.0',
    ])
    assert metric_value(page, "vllm:generation_tokens_total") == 128.0
    assert metric_value(page, "vllm:num_requests_waiting") == 3.0
    assert metric_value(page, "missing_total") == 0.0


def test_heartbeat_figures_sum_engines_and_report_the_oldest_beat() -> None:
    event = {"time": 100.0, "engines": [
        {"engine_id": "a", "time": 99.5, "stats": {"generation_tokens": 30.0, "running": 2.0, "waiting": 1.0}},
        {"engine_id": "b", "time": 98.0, "stats": {"generation_tokens": 12.0, "running": 0.0, "swapped": 1.0}}]}
    assert heartbeat_figures(event) == (42.0, 4.0, 98.0)
    assert heartbeat_figures({"time": 1.0, "engines": []}) == (0.0, 0.0, 0.0)


def test_repeated_runs_keep_the_fastest_and_list_every_time() -> None:
    prompts = [[101, 102, 103], [104] * 40]
    runs = _repeated("offline", prompts, [3, 5], 3, vocab=1000, seed=0)
    assert [r.name for r in runs] == ["offline0", "offline1", "offline2"]
    assert [r.return_tokens for r in runs] == [True, False, False]
    assert runs[0].prompts == prompts and all(r.output_lens == [3, 5] for r in runs)
    # Later runs: the same lengths, other ids (a repeated prompt would be a prefix-cache hit).
    for later in runs[1:]:
        assert [len(p) for p in later.prompts] == [3, 40] and later.prompts != prompts
        assert all(100 <= t < 900 for p in later.prompts for t in p)
    assert runs[1].prompts != runs[2].prompts
    result = {"runs": {"offline0": {"seconds": 5.0, "output_tokens": 100},
                       "offline1": {"seconds": 4.0, "output_tokens": 100},
                       "offline2": {"seconds": 4.5, "output_tokens": 100},
                       "offline_extra": {"seconds": 1.0, "output_tokens": 100}}}  # not one of the repeats
    figures = _throughput("offline")(result)
    assert figures == {"output_tokens": 100, "seconds": 4.0, "tokens_per_s": 25.0, "seconds_each": [5.0, 4.0, 4.5]}


def test_agreement_counts_identical_requests_and_common_prefix() -> None:
    result = agreement([[1, 2, 3, 4], [5, 6, 7, 8]], [[1, 2, 3, 4], [5, 6, 0, 0]])
    assert result == {"identical_requests": 1, "requests": 2, "mean_common_prefix_share": 0.75}


def test_stop_group_kills_a_child_in_a_session_of_its_own() -> None:
    # Like `pagedserve up`, the parent starts a child with start_new_session (outside its group).
    script = ("import subprocess, sys, time\n"
              "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True)\n"
              "time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    deadline = time.monotonic() + 60
    while not (tree := _descendants(proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(tree) == 1
    child, started = tree[0]
    try:
        _stop_group(proc, grace=30)
        assert proc.returncode is not None
        deadline = time.monotonic() + 30
        while alive(child, started) and time.monotonic() < deadline:  # SIGKILL is delivered asynchronously
            time.sleep(0.05)
        assert not alive(child, started)
    finally:
        if alive(child, started):
            os.kill(child, signal.SIGKILL)


def test_served_ratios_compare_client_figures_only_without_failures() -> None:
    ours = {"failed": 0, "output_tok_s": 50.0, "ttft_p50_s": 1.0, "server_output_tok_s": 50.0}
    theirs = {"failed": 0, "output_tok_s": 100.0, "ttft_p50_s": 4.0, "server_output_tok_s": 100.0}
    clean = served_ratios(ours, theirs)
    assert clean["output_tok_s_ratio"] == 0.5 and clean["ttft_p50_ratio"] == 0.25 and not clean["pagedserve_wins"]
    broken = served_ratios(ours | {"failed": 3, "server_output_tok_s": 120.0}, theirs)
    assert "output_tok_s_ratio" not in broken and "3 (pagedserve)" in broken["client_figures"]
    assert broken["server_output_tok_s_ratio"] == 1.2 and not broken["pagedserve_wins"]


def test_pagedserve_args_reach_the_server_command_word_by_word() -> None:
    args = parse_args(None, ["--pagedserve-args", "--engine-args '--max-num-batched-tokens 512' --workers 1"])
    cmd = pagedserve_spec("/models/m", 2, args.pagedserve_args).cmd
    assert cmd[-4:] == ["--engine-args", "--max-num-batched-tokens 512", "--workers", "1"]
    assert "--kv-cache-memory" in cmd and parse_args(None, []).served_systems == "pagedserve,vllm"
