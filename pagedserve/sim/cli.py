"""`pagedserve simulate`: replay a trace through contiguous and paged KV allocation.

Without --trace it generates a ShareGPT-like (or --workload alpaca) trace and, unless --quick,
also runs the sharing scenarios and the max_model_len sweep (--demo forces them for a --trace).
Prints a summary table (or --json) and writes JSON and PNG plots to artifacts/sim/.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from pagedserve.sim.report import format_table, plot_block_sweep, plot_breakdown, plot_utilization
from pagedserve.sim.simulator import BLOCK_SIZES, SimConfig
from pagedserve.sim.suite import expectations, run_comparison, run_max_len_sweep, run_sharing_scenarios
from pagedserve.sim.traces import LENGTH_MODELS, Request, TraceError, load_jsonl, synthetic_trace, with_sharing


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `pagedserve simulate`."""
    parser.add_argument("--trace", type=Path, help="JSONL trace (default: a synthetic one)")
    parser.add_argument("--workload", choices=sorted(LENGTH_MODELS), default="sharegpt")
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument("--rate", type=float, default=20.0, help="Poisson arrivals per second (inf: all at 0)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--n", type=int, default=1, help="parallel samples per synthetic request")
    parser.add_argument("--beam-width", type=int, default=1, help="beam width per synthetic request")
    parser.add_argument("--num-prefixes", type=int, default=0, help="shared system prompts to draw from")
    parser.add_argument("--prefix-len", type=int, default=0, help="tokens of each shared system prompt")
    parser.add_argument("--capacity-tokens", type=int, default=65536, help="KV budget in token slots")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--step-time", type=float, default=0.025, help="seconds per step (places arrivals)")
    parser.add_argument("--max-num-seqs", type=int, default=0, help="cap on running sequences (0: none)")
    parser.add_argument("--block-sizes", default=",".join(map(str, BLOCK_SIZES)))
    parser.add_argument("--no-sharing", action="store_true", help="also run paged without sharing")
    parser.add_argument("--demo", action="store_true",
                        help="add the sharing scenarios and max_model_len sweep (default without --trace)")
    parser.add_argument("--quick", action="store_true", help="only the policy comparison")
    parser.add_argument("--out", type=Path, help="JSON output path (default: <plots>/simulation.json)")
    parser.add_argument("--plots", type=Path, default=Path("artifacts/sim"), help="directory for PNG plots")
    parser.add_argument("--json", action="store_true", help="print the JSON summary instead of the table")


def run(args: argparse.Namespace) -> int:
    """Simulate, report, write JSON and plots; exit code 2 on a bad trace or flag."""
    try:
        config = SimConfig(args.capacity_tokens, args.max_model_len, args.step_time, args.max_num_seqs,
                           seed=args.seed)
        block_sizes = [int(b) for b in args.block_sizes.split(",") if b.strip()]
        trace = _trace(args, config)
    except (TraceError, ValueError) as exc:
        print(f"pagedserve simulate: error: {exc}", file=sys.stderr)
        return 2
    demo = args.demo or (args.trace is None and not args.quick)
    shares = any(r.width > 1 or r.prefix_id for r in trace)
    results = run_comparison(trace, config, block_sizes, both_sharing=args.no_sharing or shares)
    report: dict[str, Any] = {"config": _config_dict(args, config, trace), "policies": [r.summary() for r in results]}
    scenarios = sweep = None
    if demo and any(r.name == "paged-16" for r in results):
        scenarios = run_sharing_scenarios(trace[: max(1, len(trace) // 3)], config)
        sweep = run_max_len_sweep(trace, config, next(r for r in results if r.name == "paged-16"))
        report.update(sharing_scenarios=scenarios, max_model_len_sweep=sweep,
                      expectations=expectations(results, scenarios, sweep))
    out = args.out or args.plots / "simulation.json"
    _write_outputs(report, results, out, args.plots, config)
    print(json.dumps(report, indent=2) if args.json else _text_report(report, results, out, args.plots))
    return 0


def _trace(args: argparse.Namespace, config: SimConfig) -> list[Request]:
    if args.trace is not None:
        return load_jsonl(args.trace)
    if args.num_requests < 1 or args.rate <= 0:
        raise ValueError("--num-requests and --rate must be positive")
    trace = synthetic_trace(LENGTH_MODELS[args.workload], args.num_requests, rate=args.rate, seed=args.seed,
                            max_model_len=config.max_model_len)
    return with_sharing(trace, n=args.n, beam_width=args.beam_width, num_prefixes=args.num_prefixes,
                        prefix_len=args.prefix_len, seed=args.seed)


def _config_dict(args: argparse.Namespace, config: SimConfig, trace: list[Request]) -> dict[str, Any]:
    n = len(trace)
    return {
        "trace": str(args.trace) if args.trace else f"synthetic {args.workload}, rate {args.rate}/s",
        "num_requests": n, "mean_prompt_len": sum(r.prompt_len for r in trace) / n,
        "mean_output_len": sum(r.output_len for r in trace) / n, "capacity_tokens": config.capacity_tokens,
        "max_model_len": config.max_model_len, "step_time": config.step_time, "seed": config.seed,
    }


def _write_outputs(report: dict[str, Any], results: list[Any], out: Path, plots: Path, config: SimConfig) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**report, "series": {r.name: r.series for r in results}}, indent=1))
    plots.mkdir(parents=True, exist_ok=True)
    title = f"{report['config']['trace']}, {config.capacity_tokens} token slots, max_model_len {config.max_model_len}"
    main = [r for r in results if r.kind != "paged" or r.block_size == 16]
    plot_utilization(main, plots / "utilization.png", title)
    plot_block_sweep(results, plots / "block_sizes.png", title)
    plot_breakdown(results, plots / "breakdown.png", title)


def _text_report(report: dict[str, Any], results: list[Any], out: Path, plots: Path) -> str:
    cfg = report["config"]
    lines = [f"trace: {cfg['trace']}, {cfg['num_requests']} requests, mean prompt {cfg['mean_prompt_len']:.0f}"
             f" / output {cfg['mean_output_len']:.0f} tokens; KV budget {cfg['capacity_tokens']} token slots", "",
             format_table(results)]
    for name, s in (report.get("sharing_scenarios") or {}).items():
        lines.append(f"{name:14s} sharing saves {s['kv_saving']:.1%} of KV memory, runs {s['concurrency_gain']:.2f}x "
                     f"the sequences at once; steps {s['sharing']['steps']} vs {s['no_sharing']['steps']} without")
    for row in report.get("max_model_len_sweep") or []:
        lines.append(f"max_model_len {row['max_model_len']:5d}: contiguous utilization "
                     f"{row['contiguous_utilization']:.1%}, paged-16 mean concurrency "
                     f"{row['mean_concurrency_gain']:.1f}x (max {row['max_concurrency_gain']:.1f}x)")
    for name, check in (report.get("expectations") or {}).items():
        measured = check.get("measured", check.get("measured_mean"))
        extra = "".join(f", {v:.1f}x at max_model_len {k}" for k, v in check.get("at_max_model_len", {}).items())
        lines.append(f"{'ok  ' if check['ok'] else 'MISS'} {name}: measured {measured:.3g}{extra}")
    lines.append(f"\nJSON: {out}   plots: {plots}/utilization.png, block_sizes.png, breakdown.png")
    return "\n".join(lines)
