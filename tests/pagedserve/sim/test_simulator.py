"""The simulator: first-fit fragmentation, hand-computed runs through the real BlockManager, and
the PagedAttention paper's expectations on a small ShareGPT-like trace."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedserve.cli import main
from pagedserve.sim.contiguous import ContiguousPolicy, FirstFitAllocator
from pagedserve.sim.paged import PagedPolicy
from pagedserve.sim.simulator import SimConfig, make_policies, simulate
from pagedserve.sim.suite import run_max_len_sweep, run_sharing_scenarios
from pagedserve.sim.traces import SHAREGPT, Request, synthetic_trace


def test_first_fit_external_fragmentation_and_coalescing() -> None:
    alloc = FirstFitAllocator(10)
    a, b, c = alloc.allocate(3), alloc.allocate(3), alloc.allocate(3)
    assert (a, b, c) == (0, 3, 6)
    alloc.free(b)
    assert alloc.num_free == 4 and alloc.allocate(4) is None  # 4 slots free, but as 3 + 1
    assert alloc.free_below(4) == 4 and alloc.holes == [(3, 3), (9, 1)]
    assert alloc.allocate(1) == 3  # first fit takes the lowest hole, not the best one
    alloc.free(3)
    alloc.free(a)
    assert alloc.holes == [(0, 6), (9, 1)]
    alloc.free(c)
    assert alloc.holes == [(0, 10)]


def test_contiguous_counts_admissions_refused_by_fragmentation() -> None:
    # R0 [0,3) and R2 [10,12) finish at once around the long-lived R1 [3,10): 5 slots free as 3 + 2,
    # and R3 needs 5 contiguous ones until R1 finishes in step 4
    trace = [Request(0, 0.0, 2, 1), Request(1, 0.0, 2, 5), Request(2, 0.0, 1, 1), Request(3, 0.0, 1, 4)]
    result = simulate(ContiguousPolicy(12, max_model_len=10, oracle=True), trace,
                      SimConfig(capacity_tokens=12, max_model_len=10))
    assert (result.finished, result.steps, result.blocked_by_fragmentation) == (4, 9, 4)
    assert result.external_fragmentation == pytest.approx(4 * 5 / (12 * 9))


def test_paged_matches_hand_computation() -> None:
    config = SimConfig(capacity_tokens=16, max_model_len=16)
    result = simulate(PagedPolicy(16, 4), [Request(0, 0.0, 5, 3)], config)
    # tokens 6, 7, 8 in 2 blocks of 4 over three steps
    assert (result.steps, result.finished, result.max_concurrency) == (3, 1, 1)
    assert result.utilization == pytest.approx(21 / 24)
    assert result.internal_fragmentation == pytest.approx(3 / 24)
    contiguous = simulate(ContiguousPolicy(16, 16), [Request(0, 0.0, 5, 3)], config)
    assert contiguous.utilization == pytest.approx(21 / 48)
    assert contiguous.reservation_waste == pytest.approx(3 / 48)  # 2, 1, 0 slots still to come
    assert contiguous.internal_fragmentation == pytest.approx(24 / 48)  # 8 never used, each step


def test_paged_preempts_the_newest_by_recompute() -> None:
    # 3 blocks of 4; each request needs 2 blocks once it passes 4 tokens
    trace = [Request(0, 0.0, 4, 4), Request(1, 0.0, 4, 4)]
    result = simulate(PagedPolicy(12, 4), trace, SimConfig(capacity_tokens=12, max_model_len=16))
    # B is admitted and preempted in each of steps 0-3 while A grows; then runs alone in steps 4-7
    assert (result.finished, result.steps, result.preemptions) == (2, 8, 4)


def test_parallel_sampling_shares_the_prompt_and_copies_on_write() -> None:
    config = SimConfig(capacity_tokens=64, max_model_len=16)
    trace = [Request(0, 0.0, 6, 2, n=2)]
    shared = simulate(PagedPolicy(64, 4, sharing=True), trace, config)
    # fork: block [0-3] shared, the partial block copied once on the first write
    assert shared.cow_copies == 1
    assert shared.utilization == pytest.approx(22 / 24)  # 10/12 then 12/12
    assert shared.sharing_saving == pytest.approx(1 - 24 / 32)
    private = simulate(PagedPolicy(64, 4, sharing=False), trace, config)
    assert (private.cow_copies, private.sharing_saving) == (0, 0.0)
    assert private.utilization == pytest.approx(30 / 32)


def test_block_manager_stays_consistent_under_beams_and_prefixes() -> None:
    trace = [Request(i, i * 0.01, 40 + i, 30 + 3 * i, beam_width=4 if i % 2 else 1,
                     prefix_id="sys" if i % 3 == 0 else None, prefix_len=32 if i % 3 == 0 else 0)
             for i in range(12)]
    for sharing in (True, False):
        policy = PagedPolicy(1024, 8, sharing=sharing, seed=3)
        result = simulate(policy, trace, SimConfig(capacity_tokens=1024, max_model_len=512, step_time=0.01))
        assert result.finished == 12 and result.rejected == 0
        policy.block_manager.check_invariants()
        assert policy.block_manager.num_free_blocks == policy.block_manager.num_blocks
        assert (result.prefix_hit_tokens > 0) == sharing


def test_oversized_requests_are_rejected_not_dropped_silently() -> None:
    trace = [Request(0, 0.0, 10, 10), Request(1, 0.0, 3, 2, n=8)]
    config = SimConfig(capacity_tokens=16, max_model_len=16)
    for policy in make_policies(config, (4,)):
        result = simulate(policy, trace, config)
        assert result.rejected == 2 - result.finished and result.rejected >= 1


def test_paper_expectations_on_a_small_sharegpt_trace() -> None:
    config = SimConfig(capacity_tokens=16384, max_model_len=2048)
    trace = synthetic_trace(SHAREGPT, 120, rate=20.0, seed=0, max_model_len=2048)
    results = {r.name: r for r in (simulate(p, trace, config) for p in make_policies(config, (16,)))}
    paged, contiguous = results["paged-16"], results["contiguous-max"]
    assert paged.utilization >= 0.96
    assert 0.15 <= contiguous.utilization <= 0.40
    assert results["contiguous-oracle"].utilization < 0.9 and results["contiguous-oracle"].internal_fragmentation == 0
    assert paged.mean_concurrency >= 2.5 * contiguous.mean_concurrency
    assert paged.steps < contiguous.steps / 2
    (gain_8k,) = run_max_len_sweep(trace, config, paged, max_lens=(8192,))
    assert gain_8k["max_concurrency_gain"] >= 10
    scenarios = run_sharing_scenarios(trace[:30], config)
    assert scenarios["beam-4"]["kv_saving"] >= 0.40
    assert 0 < scenarios["parallel-n4"]["kv_saving"] < scenarios["beam-4"]["kv_saving"]


def test_simulate_cli_writes_json_and_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "--quick", "--num-requests", "40", "--block-sizes", "16,64", "--capacity-tokens", "8192",
            "--plots", str(tmp_path), "--json"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    names = [p["name"] for p in report["policies"]]
    assert names == ["contiguous-max", "contiguous-oracle", "paged-16", "paged-64"]
    assert all(p["finished"] == 40 for p in report["policies"])
    for png in ("utilization.png", "block_sizes.png", "breakdown.png"):
        assert (tmp_path / png).stat().st_size > 1000
    saved = json.loads((tmp_path / "simulation.json").read_text())
    assert set(saved["series"]) == set(names)


def test_simulate_cli_bad_flag_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--capacity-tokens", "0", "--plots", str(tmp_path)]) == 2
    assert "error" in capsys.readouterr().err
