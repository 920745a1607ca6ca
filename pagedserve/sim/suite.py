"""The simulator's experiments: the policy comparison on one trace, the sharing scenarios
(parallel sampling, beam search, shared system prompts, each with and without sharing), the
contiguous baseline at several max_model_len, and the PagedAttention paper's expectations."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import Any

from tqdm import tqdm

from pagedserve.sim.contiguous import ContiguousPolicy
from pagedserve.sim.metrics import PolicyResult
from pagedserve.sim.paged import PagedPolicy
from pagedserve.sim.simulator import BLOCK_SIZES, SimConfig, make_policies, simulate
from pagedserve.sim.traces import Request, with_sharing
from pagedserve.sim.types import Policy

SCENARIOS: dict[str, dict[str, int]] = {
    "parallel-n4": {"n": 4},
    "beam-4": {"beam_width": 4},
    "system-prompt": {"num_prefixes": 4, "prefix_len": 256},
}


def run_policies(policies: Iterable[Policy], trace: list[Request], config: SimConfig,
                 label: str = "") -> list[PolicyResult]:
    """Simulate each policy on the trace, with a progress bar per policy."""
    results = []
    for policy in policies:
        with tqdm(total=len(trace), desc=f"{label}{policy.name}", unit="req", leave=False,
                  disable=None) as bar:
            def advance(done: int, bar: Any = bar) -> None:
                bar.update(done - bar.n)

            results.append(simulate(policy, trace, config, on_step=advance))
    return results


def run_comparison(trace: list[Request], config: SimConfig, block_sizes: Iterable[int] = BLOCK_SIZES,
                   both_sharing: bool = False) -> list[PolicyResult]:
    """Contiguous max, contiguous oracle and paged per block size, at one memory budget."""
    return run_policies(make_policies(config, block_sizes, both_sharing=both_sharing), trace, config)


def run_sharing_scenarios(trace: list[Request], config: SimConfig, block_size: int = 16
                          ) -> dict[str, dict[str, Any]]:
    """Each scenario on paged blocks with and without sharing. `kv_saving` is the paper's
    measure: blocks saved by sharing / blocks the same sequences would hold without it, summed
    over the run (it equals the drop in reserved memory per running sequence against the
    no-sharing run, since every sequence passes through each of its lengths once either way);
    `concurrency_gain` is how many more sequences ran at once with sharing."""
    out: dict[str, dict[str, Any]] = {}
    for name, shape in SCENARIOS.items():
        shaped = with_sharing(trace, seed=config.seed, **shape)
        policies = [PagedPolicy(config.capacity_tokens, block_size, sharing=s, beam_keep=config.beam_keep,
                                seed=config.seed) for s in (True, False)]
        shared, private = run_policies(policies, shaped, config, label=f"{name} ")
        gain = shared.mean_concurrency / private.mean_concurrency if private.mean_concurrency else 0.0
        out[name] = {"kv_saving": shared.sharing_saving, "concurrency_gain": gain,
                     "sharing": shared.summary(), "no_sharing": private.summary()}
    return out


def run_max_len_sweep(trace: list[Request], config: SimConfig, paged: PolicyResult,
                      max_lens: Iterable[int] = (2048, 4096, 8192)) -> list[dict[str, Any]]:
    """Contiguous-max at several max_model_len against one paged result (which does not
    depend on max_model_len): the concurrency gain grows with the reservation."""
    rows = []
    for max_len in max_lens:
        cfg = replace(config, max_model_len=max_len)
        (contiguous,) = run_policies([ContiguousPolicy(cfg.capacity_tokens, max_len)], trace, cfg,
                                     label=f"max_len={max_len} ")
        rows.append({
            "max_model_len": max_len, "contiguous_utilization": contiguous.utilization,
            "contiguous_mean_concurrency": contiguous.mean_concurrency,
            "contiguous_max_concurrency": contiguous.max_concurrency,
            "mean_concurrency_gain": paged.mean_concurrency / contiguous.mean_concurrency,
            "max_concurrency_gain": paged.max_concurrency / contiguous.max_concurrency,
            "contiguous_steps": contiguous.steps, "paged_steps": paged.steps,
        })
    return rows


def expectations(results: list[PolicyResult], scenarios: dict[str, dict[str, Any]] | None,
                 sweep: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """The PagedAttention paper's claims next to what this run measured."""
    by_name = {r.name: r for r in results}
    paged, contiguous = by_name["paged-16"], by_name["contiguous-max"]
    checks: dict[str, dict[str, Any]] = {
        "paged_utilization_ge_96pct": {"measured": paged.utilization, "ok": paged.utilization >= 0.96},
        "contiguous_max_utilization_20_40pct": {
            "measured": contiguous.utilization, "ok": 0.20 <= contiguous.utilization <= 0.40},
        "paged_concurrency_ge_10x_contiguous": {
            "measured_mean": paged.mean_concurrency / contiguous.mean_concurrency,
            "measured_max": paged.max_concurrency / contiguous.max_concurrency,
            "ok": paged.mean_concurrency >= 10 * contiguous.mean_concurrency},
    }
    if sweep:
        best = max(sweep, key=lambda row: row["mean_concurrency_gain"])
        checks["paged_concurrency_ge_10x_contiguous"]["at_max_model_len"] = {
            str(row["max_model_len"]): row["mean_concurrency_gain"] for row in sweep}
        checks["paged_concurrency_ge_10x_contiguous"]["ok_at_largest_max_model_len"] = (
            best["mean_concurrency_gain"] >= 10)
    if scenarios:
        saving = scenarios["beam-4"]["kv_saving"]
        checks["beam4_sharing_saves_ge_40pct"] = {"measured": saving, "ok": saving >= 0.40}
    return checks
