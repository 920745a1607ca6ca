"""Engine throughput: pagedserve against Hugging Face generate() on one trace, in one process.

Every request has a fixed output length (ignore_eos / min_new_tokens), so "useful" tokens are
the same for every system: HF's padded static batches waste the positions past each request's
own length. Prints JSON lines: tokens/s per system, the ratio to HF's best, the peak KV memory
against a contiguous cache, preemptions, block utilization and the step overhead share.

    python benchmarks/engine/engine_bench.py --num-requests 128
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from common.sampling_params import SamplingParams
from engine.llm import LLM
from engine.model.capacity import resolve_device, resolve_model_dtype


def make_trace(num_requests: int, vocab: int, seed: int, lo: int, hi: int) -> list[tuple[list[int], int]]:
    """ShareGPT-shaped (log-normal, long tail) prompt and output lengths clipped to [lo, hi]."""
    rng = np.random.default_rng(seed)
    prompt_lens = np.clip(np.rint(rng.lognormal(np.log(90), 0.8, num_requests)), lo, hi).astype(int)
    output_lens = np.clip(np.rint(rng.lognormal(np.log(110), 0.8, num_requests)), lo, hi).astype(int)
    return [
        (rng.integers(100, vocab - 100, size=int(p)).tolist(), int(o))
        for p, o in zip(prompt_lens, output_lens, strict=True)
    ]


def emit(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)


def run_pagedserve(model: str, trace: list[tuple[list[int], int]], args: argparse.Namespace) -> dict[str, Any]:
    llm = LLM(model, device=args.device, dtype=args.dtype, kv_cache_memory=args.kv_cache_memory,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
    engine = llm.engine
    for i, (prompt, out_len) in enumerate(trace):
        params = SamplingParams(temperature=0.0, max_tokens=out_len, min_tokens=out_len, ignore_eos=True)
        engine.add_request(f"bench-{i}", prompt, params)
    manager = engine.block_manager
    peak_blocks, util_samples, useful = 0, [], 0
    start = time.perf_counter()
    with tqdm(total=len(trace), desc="pagedserve", unit="req", file=sys.stderr) as bar:
        while engine.has_unfinished_requests():
            for out in engine.step():
                useful += sum(len(c.token_ids) for c in out.outputs)
                bar.update(int(out.finished))
            peak_blocks = max(peak_blocks, manager.num_used_blocks)
            if manager.num_used_blocks:
                util_samples.append(manager.stats().block_utilization)
    elapsed = time.perf_counter() - start
    stats = engine.stats()
    block_bytes = engine.runner.kv_caches[0][0][0].numel() * engine.runner.kv_caches[0][0].element_size() * 2
    block_bytes *= len(engine.runner.kv_caches)
    bytes_per_token = block_bytes // manager.block_size
    concurrent = min(len(trace), args.max_num_seqs)
    contiguous = concurrent * engine.max_model_len * bytes_per_token
    return {
        "system": "pagedserve",
        "useful_tokens": useful,
        "seconds": round(elapsed, 2),
        "tokens_per_s": round(useful / elapsed, 2),
        "steps": stats["num_steps"],
        "step_overhead_share": round(1 - stats["model_seconds"] / stats["step_seconds"], 4),
        "peak_kv_bytes": peak_blocks * block_bytes,
        "contiguous_kv_bytes_at_max_len": contiguous,
        "peak_kv_vs_contiguous": round(peak_blocks * block_bytes / contiguous, 4),
        "mean_block_utilization": round(float(np.mean(util_samples)), 4) if util_samples else 0.0,
        "preemptions": stats["preemptions"],
        "num_blocks": stats["num_blocks"],
    }


def run_hf(model_dir: str, trace: list[tuple[list[int], int]], batch_size: int,
           device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """Static batches, left-padded, generated to the batch's longest output."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    pad = int(model.config.eos_token_id if isinstance(model.config.eos_token_id, int) else 0)
    useful, start = 0, time.perf_counter()
    batches = [trace[i : i + batch_size] for i in range(0, len(trace), batch_size)]
    with torch.inference_mode():
        for batch in tqdm(batches, desc=f"hf batch {batch_size}", unit="batch", file=sys.stderr):
            width = max(len(p) for p, _ in batch)
            new = max(o for _, o in batch)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in batch], device=device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch], device=device)
            model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new,
                           min_new_tokens=new, pad_token_id=pad)
            useful += sum(o for _, o in batch)
    elapsed = time.perf_counter() - start
    return {"system": f"hf_static_batch_{batch_size}", "requests": len(trace), "useful_tokens": useful,
            "seconds": round(elapsed, 2), "tokens_per_s": round(useful / elapsed, 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF model directory (default: SmolLM2, fetched)")
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hf-batch-sizes", default="1,8,32")
    parser.add_argument("--hf-requests", default="1=8,8=32",
                        help="SIZE=K: run HF batch SIZE on the first K requests only (a rate; small batches "
                             "are slow); sizes not listed run the whole trace")
    parser.add_argument("--kv-cache-memory", type=int, default=1 << 30)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, help="tokens per step (default: the engine's)")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda[:N] (HF runs on the same device)")
    parser.add_argument("--dtype", default="auto", help="auto (fp32 on CPU, bf16 on CUDA) | float32 | bfloat16")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    if args.model is None:
        from engine.model.fetch import default_model_dir

        args.model = str(default_model_dir())
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    trace = make_trace(args.num_requests, vocab, args.seed, args.min_len, args.max_len)
    emit({"trace": "sharegpt-like", "requests": len(trace), "prompt_tokens": sum(len(p) for p, _ in trace),
          "output_tokens": sum(o for _, o in trace), "threads": torch.get_num_threads()})
    ours = run_pagedserve(args.model, trace, args)
    emit(ours)
    device = resolve_device(args.device)  # HF runs where and in what dtype the engine did
    dtype = getattr(torch, resolve_model_dtype(args.dtype, device))
    best = 0.0
    limits = {int(k): int(v) for k, v in (item.split("=") for item in args.hf_requests.split(",") if item)}
    for size in (int(s) for s in args.hf_batch_sizes.split(",") if s):
        subset = trace[: limits.get(size, len(trace))]
        result = run_hf(args.model, subset, size, device, dtype)
        emit(result)
        best = max(best, result["tokens_per_s"])
    if best:
        emit({"ratio_vs_best_hf": round(ours["tokens_per_s"] / best, 2), "goal": 4.0})
    return 0


if __name__ == "__main__":
    sys.exit(main())
