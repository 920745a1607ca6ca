"""Decode and prefill speed of the engine on SmolLM2 (or --model), this tree against a baseline tree.

Each figure is measured in a fresh process per tree, the trees alternating round by round so that
load from other processes hits both alike; the best round counts. Figures per tree:

- ``single_stream_tok_s``: one request decoding alone (the chat case; vLLM's CPU build: 46 tok/s);
- ``batch_step_ms``: one decode step of ``--batch`` running requests (tok/s = batch / step);
- ``prefill_burst_ms``: ``--burst`` prompts arriving together, until every one has its first token;
- ``matmul_gbps`` (this tree only): the model's linear layers at one row, all layers in order as a
  decode step runs them, through ``ops.linear`` and through plain ``F.linear``.

    python benchmarks/engine/decode_bench.py --baseline /path/to/other/checkout
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def make_engine(model: str, kv_cache_memory: int, kv_cache_dtype: str = "auto") -> Any:
    from engine.llm import LLM

    return LLM(model, kv_cache_memory=kv_cache_memory, max_num_batched_tokens=4096,
               kv_cache_dtype=kv_cache_dtype).engine


def add_requests(engine: Any, name: str, num: int, prompt_len: int, max_tokens: int, seed: int) -> None:
    import torch

    from common.sampling_params import SamplingParams

    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(num):
        engine.add_request(f"{name}-{i}", torch.randint(100, 40000, (prompt_len,), generator=gen).tolist(), params)


def _decode_steps(engine: Any, steps: int) -> list[float]:
    while engine.scheduler.waiting:  # prefill everything first
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times


def drain(engine: Any) -> None:
    for request_id in list(engine.requests):
        engine.abort_request(request_id)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Every engine figure for the tree this process imports."""
    engine = make_engine(args.model, 1 << 30)
    add_requests(engine, "warm", 2, 32, 8, 0)
    while engine.has_unfinished_requests():
        engine.step()
    add_requests(engine, "single", 1, args.prompt_len, args.steps + 4, 1)
    single = _decode_steps(engine, args.steps)[2:]
    drain(engine)
    add_requests(engine, "batch", args.batch, args.prompt_len, args.steps + 4, 2)
    batch = _decode_steps(engine, args.steps)[2:]
    drain(engine)
    add_requests(engine, "burst", args.burst, args.prompt_len, 1, 3)
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    burst = time.perf_counter() - start
    return {
        "single_stream_tok_s": round(1 / statistics.median(single), 2),
        "batch_step_ms": round(statistics.median(batch) * 1e3, 2),
        "prefill_burst_ms": round(burst * 1e3, 1),
    }


def matmul_rates(model: str, reps: int) -> dict[str, float]:
    """GB/s of weight read by the model's linear layers at M=1, ops.linear vs F.linear (this tree)."""
    import torch
    import torch.nn.functional as F

    import ops
    from engine.model.loader import load_model

    net = load_model(model)
    weights = [m.weight for m in net.modules() if isinstance(m, torch.nn.Linear)]
    total = sum(w.numel() * w.element_size() for w in weights)
    xs = {w.shape[1]: torch.randn(1, w.shape[1]) for w in weights}
    rates: dict[str, float] = {}
    with torch.inference_mode():
        for name, fn in (("ops_linear", ops.linear), ("torch_linear", F.linear)):
            best = float("inf")
            for _ in range(reps):
                start = time.perf_counter()
                for w in weights:
                    fn(xs[w.shape[1]], w)
                best = min(best, time.perf_counter() - start)
            rates[f"matmul_gbps_{name}"] = round(total / best / 1e9, 2)
    return rates


def _worker(tree: Path, args: argparse.Namespace, extra: list[str]) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--model", args.model,
           "--batch", str(args.batch), "--burst", str(args.burst), "--steps", str(args.steps),
           "--prompt-len", str(args.prompt_len), *extra]
    done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"worker in {tree} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF directory (default: the fetched SmolLM2)")
    parser.add_argument("--baseline", type=Path, default=None, help="another checkout to compare against")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--burst", type=int, default=16)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--matmul", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.model is None:
        from engine.model.fetch import default_model_dir

        args.model = str(default_model_dir(progress=False))
    if args.worker:
        result = matmul_rates(args.model, 5) if args.matmul else measure(args)
        print(json.dumps(result), flush=True)
        return
    trees = {"this": ROOT} | ({"baseline": args.baseline.resolve()} if args.baseline else {})
    best: dict[str, dict[str, Any]] = {name: {} for name in trees}
    lower_is_better = ("batch_step_ms", "prefill_burst_ms")
    for round_ in range(args.rounds):
        for name, tree in trees.items():
            result = _worker(tree, args, [])
            print(json.dumps({"bench": "decode_round", "tree": name, "round": round_, **result}), flush=True)
            for key, value in result.items():
                old = best[name].get(key)
                better = old is None or (value < old if key in lower_is_better else value > old)
                best[name][key] = value if better else old
    for name in trees:
        print(json.dumps({"bench": "decode", "tree": name, "path": str(trees[name]), **best[name]}), flush=True)
    print(json.dumps({"bench": "matmul", "tree": "this", **_worker(ROOT, args, ["--matmul"])}), flush=True)
    if args.baseline:
        this, base = best["this"], best["baseline"]
        print(json.dumps({
            "bench": "decode_summary",
            "single_stream_speedup": round(this["single_stream_tok_s"] / base["single_stream_tok_s"], 3),
            "batch_step_speedup": round(base["batch_step_ms"] / this["batch_step_ms"], 3),
            "prefill_burst_speedup": round(base["prefill_burst_ms"] / this["prefill_burst_ms"], 3),
        }), flush=True)


if __name__ == "__main__":
    main()
