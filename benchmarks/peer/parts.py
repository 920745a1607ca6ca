"""The four parts of benchmarks/peer/peer_bench.py. Each prints one JSON line per system, then one with
the ratios (pagedserve / vLLM: above 1 for throughput, below 1 for latency means pagedserve wins)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.engine.engine_bench import make_trace
from benchmarks.peer.offline import Run, Workload, agreement, run_pagedserve, run_vllm
from benchmarks.peer.served import ServerSpec, bench_serve, pagedserve_spec, server, vllm_spec
from benchmarks.peer.tiny_model import tiny_model_dir

Emit = Callable[[dict[str, Any]], None]
SETUP_HINT = "run `bash benchmarks/peer/setup_vllm.sh` (or pass --vllm-venv DIR)"


def peer_cache() -> Path:
    from engine.model.fetch import cache_root

    return cache_root() / "peer"


def vllm_venv(given: str | None) -> Path | None:
    """vLLM's virtualenv if it is installed there, else None (with a message on stderr)."""
    path = Path(given or os.environ.get("VLLM_VENV") or peer_cache() / "vllm-venv").expanduser()
    if (path / "bin" / "python").is_file() and (path / "bin" / "vllm").is_file():
        return path
    print(f"vLLM venv not found at {path}: vLLM figures are skipped; {SETUP_HINT}", file=sys.stderr, flush=True)
    return None


def load_1m() -> float:
    return round(os.getloadavg()[0], 2)


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


def model_dir(args: argparse.Namespace) -> str:
    if args.model is None:
        from engine.model.fetch import default_model_dir

        args.model = str(default_model_dir())
    return str(args.model)


def _random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(100, vocab - 100, size=length).tolist() for _ in range(n)]


def _vocab(model: str) -> int:
    return int(json.loads((Path(model) / "config.json").read_text())["vocab_size"])


def _side_by_side(part: str, work: Workload, venv: Path | None, log_dir: Path, emit: Emit,
                  figures: Callable[[dict[str, Any]], dict[str, Any]], higher_is_better: str) -> tuple[Any, Any]:
    """Run `work` on both systems; emit each system's `figures` and the ratio of `higher_is_better`."""
    loads: dict[str, list[float]] = {"pagedserve": [load_1m()]}
    results: dict[str, Any] = {"pagedserve": run_pagedserve(work)}
    loads["pagedserve"].append(load_1m())
    if venv is None:
        emit({"part": part, "system": "vllm", "skipped": f"no vLLM venv: {SETUP_HINT}"})
    else:
        loads["vllm"] = [load_1m()]
        results["vllm"] = run_vllm(work, venv, log_dir / f"vllm-{part}.log")
        loads["vllm"].append(load_1m())
    for system, result in results.items():
        emit({"part": part, "system": system, **work.extra, **figures(result),
              "startup_s": round(result["startup_s"], 1), "config": result["config"],
              "loadavg_1m_start_end": loads[system]})
    if "vllm" in results:
        ours, theirs = figures(results["pagedserve"])[higher_is_better], figures(results["vllm"])[higher_is_better]
        emit({"part": part, "ratio": "pagedserve/vllm", f"{higher_is_better}_ratio": round(ours / theirs, 3),
              "pagedserve_wins": ours > theirs})
    return results["pagedserve"], results.get("vllm")


def _repeated(name: str, prompts: list[list[int]], lens: list[int], repeats: int, vocab: int,
              seed: int) -> list[Run]:
    """`repeats` timed runs `name0`, `name1`, ... of the same work: the first on `prompts` (it returns
    its token ids), each later one on fresh random ids of the same lengths, since a repeated prompt
    would be a prefix-cache hit (both systems cache prefixes) and skip its prefill."""
    runs = [Run(f"{name}0", prompts, lens, return_tokens=True)]
    for r in range(1, max(1, repeats)):
        rng = np.random.default_rng([seed, r])
        fresh = [rng.integers(100, vocab - 100, size=len(p)).tolist() for p in prompts]
        runs.append(Run(f"{name}{r}", fresh, lens))
    return runs


def _throughput(name: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """Figures of the fastest of the runs `name0`, `name1`, ... (every run's seconds listed too):
    both systems get the same number of tries, so a few seconds of interference on this shared
    machine cost neither side its result."""
    def figures(result: dict[str, Any]) -> dict[str, Any]:
        runs = [run for key, run in result["runs"].items() if key.removeprefix(name).isdigit()]
        best = min(runs, key=lambda run: run["seconds"])
        return {"output_tokens": best["output_tokens"], "seconds": round(best["seconds"], 2),
                "tokens_per_s": round(best["output_tokens"] / best["seconds"], 2),
                "seconds_each": [round(run["seconds"], 2) for run in runs]}
    return figures


def _model_workload(args: argparse.Namespace, model: str, runs: list[Run], warmup: tuple[list[int], int],
                    extra: dict[str, Any]) -> Workload:
    """A workload on the full model, each system in the configuration the command line names (its
    settings listed in `extra` too, so every JSON line says what ran)."""
    extra = extra | {"model": Path(model).name, "pagedserve_model": Path(args.pagedserve_model or model).name,
                     "vllm_dtype": args.vllm_dtype, "pagedserve_dtype": args.pagedserve_dtype,
                     "pagedserve_kv_cache_dtype": args.pagedserve_kv_cache_dtype,
                     "pagedserve_int8_prompt_activations": args.pagedserve_int8_prompt_activations,
                     "pagedserve_deterministic": not args.pagedserve_no_deterministic}
    return Workload(model, runs, warmup, args.max_model_len, args.kv_cache_gib, extra, args.pagedserve_model,
                    args.vllm_dtype, args.pagedserve_dtype, args.pagedserve_kv_cache_dtype,
                    not args.pagedserve_int8_prompt_activations, not args.pagedserve_no_deterministic)


def offline(args: argparse.Namespace, venv: Path | None, log_dir: Path, emit: Emit) -> None:
    model = model_dir(args)
    trace = make_trace(args.num_requests, _vocab(model), args.seed, args.min_len, args.max_len)
    prompts, lens = [p for p, _ in trace], [o for _, o in trace]
    runs = _repeated("offline", prompts, lens, args.repeats, _vocab(model), args.seed)
    work = _model_workload(args, model, runs, (prompts[0][:16], 4),
                           {"requests": len(trace), "prompt_tokens": sum(map(len, prompts))})
    ours, theirs = _side_by_side("offline", work, venv, log_dir, emit, _throughput("offline"), "tokens_per_s")
    if theirs is not None:
        emit({"part": "offline", "greedy_agreement": agreement(ours["runs"]["offline0"]["token_ids"],
                                                               theirs["runs"]["offline0"]["token_ids"])})


def tiny(args: argparse.Namespace, venv: Path | None, log_dir: Path, emit: Emit) -> None:
    model = str(tiny_model_dir(Path(model_dir(args)), peer_cache()))
    prompts = _random_prompts(args.tiny_seqs, args.tiny_prompt_len, _vocab(model), args.seed)
    runs = _repeated("tiny", prompts, [args.tiny_output_len] * len(prompts), args.repeats, _vocab(model), args.seed)
    work = Workload(model, runs, (prompts[0][:16], 4), args.max_model_len, args.kv_cache_gib,
                    {"sequences": len(prompts), "prompt_len": args.tiny_prompt_len,
                     "output_len": args.tiny_output_len, "model": Path(model).name})
    _side_by_side("tiny", work, venv, log_dir, emit, _throughput("tiny"), "tokens_per_s")


def single(args: argparse.Namespace, venv: Path | None, log_dir: Path, emit: Emit) -> None:
    model = model_dir(args)
    prompt = _random_prompts(1, args.single_prompt_len, _vocab(model), args.seed + 7)[0]
    n = args.single_output_len
    runs = [Run(f"{kind}{r}", [prompt], [1 if kind == "first" else n + 1])
            for r in range(args.single_repeats) for kind in ("first", "full")]

    def figures(result: dict[str, Any]) -> dict[str, Any]:
        first = min(v["seconds"] for k, v in result["runs"].items() if k.startswith("first"))
        full = min(v["seconds"] for k, v in result["runs"].items() if k.startswith("full"))
        return {"decode_tokens": n, "first_token_s": round(first, 4), "decode_tok_s": round(n / (full - first), 2)}

    work = _model_workload(args, model, runs, (prompt[:16], 4), {"prompt_len": len(prompt)})
    _side_by_side("single", work, venv, log_dir, emit, figures, "decode_tok_s")


def served(args: argparse.Namespace, venv: Path | None, log_dir: Path, emit: Emit) -> None:
    if venv is None:
        emit({"part": "served", "skipped": f"the client is `vllm bench serve` and there is no vLLM venv: {SETUP_HINT}"})
        return
    model = model_dir(args)
    # The bounded run gets new prompts (seed + 1): the first run's would be prefix-cache hits.
    loads: list[tuple[str, int | None, int]] = [
        ("all_at_once", None, args.seed),
        (f"max_concurrency_{args.served_concurrency}", args.served_concurrency, args.seed + 1)]
    figures: dict[tuple[str, str], dict[str, Any]] = {}
    systems: dict[str, Callable[[], ServerSpec]] = {
        "pagedserve": lambda: pagedserve_spec(model, args.kv_cache_gib, args.pagedserve_args),
        "vllm": lambda: vllm_spec(venv, model, args.kv_cache_gib, args.max_model_len, args.vllm_dtype),
    }
    chosen = {s.strip() for s in args.served_systems.split(",")}
    systems = {name: make for name, make in systems.items() if name in chosen}
    for system, make in systems.items():  # one server at a time: memory, and a fair machine
        try:
            _serve_and_bench(system, make, args, venv, model, loads, log_dir, emit, figures)
        except RuntimeError as exc:  # the other system still runs
            print(f"served {system}: failed: {exc}", file=sys.stderr, flush=True)
            emit({"part": "served", "system": system, "error": str(exc).splitlines()[0]})
    for load, _, _ in loads:
        if ("pagedserve", load) in figures and ("vllm", load) in figures:
            emit({"part": "served", "load": load, **served_ratios(figures[("pagedserve", load)],
                                                                 figures[("vllm", load)])})


def served_ratios(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, Any]:
    """pagedserve / vLLM. The client's figures only count when neither system had failed requests
    (a failed request adds no tokens and no TTFT); the server-side rate always counts."""
    record: dict[str, Any] = {"ratio": "pagedserve/vllm", "server_output_tok_s_ratio":
                              round(ours["server_output_tok_s"] / theirs["server_output_tok_s"], 3)}
    if ours["failed"] or theirs["failed"]:
        record["client_figures"] = (f"not compared: {ours['failed']} (pagedserve) and {theirs['failed']} (vLLM) "
                                    "requests failed in the client")
    else:
        record["output_tok_s_ratio"] = round(ours["output_tok_s"] / theirs["output_tok_s"], 3)
        record["ttft_p50_ratio"] = round(ours["ttft_p50_s"] / theirs["ttft_p50_s"], 3)
    record["pagedserve_wins"] = ours["server_output_tok_s"] > theirs["server_output_tok_s"] and not ours["failed"]
    return record


def _serve_and_bench(system: str, make: Callable[[], ServerSpec],
                     args: argparse.Namespace, venv: Path, model: str, loads: list[tuple[str, int | None, int]],
                     log_dir: Path, emit: Emit, figures: dict[tuple[str, str], dict[str, Any]]) -> None:
    """Start one server, run every load against it with the same client, stop it."""
    spec = make()
    print(f"starting {system}: {' '.join(spec.cmd)}", file=sys.stderr, flush=True)
    with server(spec, log_dir / f"serve-{system}.log", args.server_timeout) as (_, name):
        for load, concurrency, seed in loads:
            print(f"  vllm bench serve: {load}", file=sys.stderr, flush=True)
            start_load = load_1m()
            result = bench_serve(venv, spec, name, model, log_dir / f"bench-{system}-{load}.json",
                                 num_prompts=args.served_prompts, input_len=args.served_input_len,
                                 output_len=args.served_output_len, concurrency=concurrency, seed=seed)
            figures[(system, load)] = result
            emit({"part": "served", "system": system, "load": load, "served_model": name,
                  "prompts": args.served_prompts, "input_len": args.served_input_len,
                  "output_len": args.served_output_len, **result, "loadavg_1m_start_end": [start_load, load_1m()]})


PARTS: dict[str, Callable[[argparse.Namespace, Path | None, Path, Emit], None]] = {
    "offline": offline, "tiny": tiny, "single": single, "served": served,
}
