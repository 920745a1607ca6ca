"""Engine host overhead: what a step costs beyond the model, on a model whose step is nearly all
overhead (SmolLM2's shape cut to 2 layers, random weights: hidden 576, 9 heads, 3 KV heads,
head 64, MLP 1536, vocabulary 49152).

Parts (JSON lines each):
  decode      host time per decode step at batch 256 (step wall time minus the model's forward
              and lm_head), median over the steps where all 256 sequences decode; and the
              offline throughput of 256 sequences x 256 output tokens (32-token prompts)
  structured  tokens/s at batch 32 with and without a JSON-schema token mask (sampled)
  budget      burst TTFT and throughput for token budgets (max_num_batched_tokens)
  overlap     can host work hide behind the forward here? A batch-256 decode forward alone, a
              step's worth of Python host work alone (the scheduler's update and deltas), and
              both at once (host work on a second thread, as async scheduling would run it)

    python benchmarks/engine/engine_overhead_bench.py --parts decode,structured
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from common.sampling_params import SamplingParams
from engine.llm import LLM

SHAPE = {"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 2,
         "num_attention_heads": 9, "num_key_value_heads": 3, "max_position_embeddings": 8192,
         "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "tie_word_embeddings": True,
         "bos_token_id": 1, "eos_token_id": 2}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer"}, "tags": {"type": "array",
                                           "items": {"type": "string", "maxLength": 8}, "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}


def emit(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)


def tiny_model(directory: Path, smollm2: Path | None) -> Path:
    """The random 2-layer model (with SmolLM2's tokenizer files when given, for the mask part)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if not (directory / "config.json").is_file():
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**SHAPE)).save_pretrained(str(directory))
    if smollm2 is not None:
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (smollm2 / name).is_file() and not (directory / name).is_file():
                (directory / name).write_bytes((smollm2 / name).read_bytes())
    return directory


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(100, SHAPE["vocab_size"] - 100, (n, length), generator=gen).tolist()


def _model_seconds(engine: Any) -> float:
    """Time inside the model so far: its forward (the runner's) and its lm_head (the sampling stage's)."""
    return engine.runner.model_seconds + engine.sampler.head_seconds


def decode(model: str, args: argparse.Namespace) -> None:
    llm = LLM(model, kv_cache_memory=2 << 30, max_num_batched_tokens=args.max_num_batched_tokens)
    engine, n, out_len = llm.engine, args.batch, args.output_len
    llm.generate(_prompts(4, 32, 1), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm-up
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=0, max_tokens=out_len,
                            min_tokens=out_len, ignore_eos=True)
    with_logprobs = dataclasses.replace(params, logprobs=1)
    for i, prompt in enumerate(_prompts(n, 32, 0)):
        engine.add_request(f"d{i}", prompt, with_logprobs if i < args.logprobs_rows else params)
    host, step_ms, tokens = [], [], 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        s0, m0 = engine.step_seconds, _model_seconds(engine)
        outs = engine.step()
        tokens += sum(len(c.token_ids) for o in outs for c in o.outputs)
        step, model_s = engine.step_seconds - s0, _model_seconds(engine) - m0
        if engine.last_step_decodes == n:
            host.append((step - model_s) * 1e3)
            step_ms.append(step * 1e3)
    elapsed = time.perf_counter() - start
    emit({"part": "decode", "batch": n, "temperature": args.temperature, "top_p": args.top_p,
          "logprobs_rows": args.logprobs_rows,
          "host_ms_per_decode_step_median": round(statistics.median(host), 2),
          "host_ms_p90": round(sorted(host)[int(0.9 * len(host))], 2),
          "step_ms_median": round(statistics.median(step_ms), 2), "decode_steps": len(host),
          "output_tokens": tokens, "seconds": round(elapsed, 2), "tokens_per_s": round(tokens / elapsed, 1),
          "threads": torch.get_num_threads()})


def structured(model: str, args: argparse.Namespace) -> None:
    llm = LLM(model, kv_cache_memory=1 << 30)
    prompts = _prompts(32, 32, 2)
    results = {}
    for label, so in (("plain", None), ("json_schema", {"kind": "json_schema", "spec": json.dumps(SCHEMA)})):
        params = [SamplingParams(temperature=1.0, seed=i, max_tokens=64, structured_output=so) for i in range(32)]
        llm.generate(prompts[:2], params[:2])  # warm-up (and the grammar compile for the mask)
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        results[label] = tokens / elapsed
        emit({"part": "structured", "mode": label, "batch": 32, "output_tokens": tokens,
              "seconds": round(elapsed, 2), "tokens_per_s": round(tokens / elapsed, 1)})
    emit({"part": "structured", "mask_throughput_ratio": round(results["json_schema"] / results["plain"], 3)})


def budget(model: str, args: argparse.Namespace) -> None:
    prompts = _prompts(96, 128, 3)
    params = SamplingParams(temperature=0.0, max_tokens=32, min_tokens=32, ignore_eos=True)
    for tokens in (int(b) for b in args.budgets.split(",")):
        llm = LLM(model, kv_cache_memory=1 << 30, max_num_batched_tokens=tokens)
        engine = llm.engine
        llm.generate(_prompts(2, 16, 9), SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
        start = time.perf_counter()
        for i, prompt in enumerate(prompts):
            engine.add_request(f"b{i}", prompt, params)
        first: dict[str, float] = {}
        out_tokens = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                out_tokens += sum(len(c.token_ids) for c in out.outputs)
                first.setdefault(out.request_id, time.perf_counter() - start)
        elapsed = time.perf_counter() - start
        ttft = sorted(first.values())
        emit({"part": "budget", "max_num_batched_tokens": tokens, "requests": len(prompts), "prompt_len": 128,
              "ttft_p50_s": round(ttft[len(ttft) // 2], 3), "ttft_p90_s": round(ttft[int(0.9 * len(ttft))], 3),
              "tokens_per_s": round(out_tokens / elapsed, 1), "seconds": round(elapsed, 2)})
        del llm


def overlap(model: str, args: argparse.Namespace) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from engine.sched.output import StepSamples

    llm = LLM(model, kv_cache_memory=2 << 30)
    engine, n = llm.engine, args.batch
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    for i, prompt in enumerate(_prompts(n, 32, 0)):
        engine.add_request(f"o{i}", prompt, params)
    while engine.last_step_decodes != n:
        engine.step()
    sched = engine.scheduler.schedule()
    batch = engine.runner.prepare(sched.scheduled)
    samples = StepSamples(seqs=[s.seq for s in sched.scheduled], token_ids=[[7] for _ in sched.scheduled])
    post = engine.scheduler.post

    def forward() -> None:
        with torch.inference_mode():
            hidden = engine.model(batch.input_ids, batch.positions, engine.runner.kv_caches, batch.meta)
            engine.model.compute_logits(hidden).max(dim=-1)

    def host() -> None:  # the per-row Python of an update: appends, stop checks, deltas (then undone)
        for seq in samples.seqs:
            post.stop_reason(seq, 7)
        outs = [post._delta(seq) for seq in samples.seqs]
        for seq, out in zip(samples.seqs, outs, strict=True):
            seq.num_emitted -= len(out.token_ids)

    def timed(fn: Any, reps: int = 8) -> float:
        fn()
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - start) / reps * 1e3

    with ThreadPoolExecutor(1) as pool:
        def both() -> None:
            future = pool.submit(lambda: [host() for _ in range(8)])
            forward()
            future.result()
        t_fwd, t_host8, t_both = timed(forward), timed(lambda: [host() for _ in range(8)]), timed(both)
    emit({"part": "overlap", "batch": n, "forward_ms": round(t_fwd, 2), "host_ms": round(t_host8, 2),
          "sequential_ms": round(t_fwd + t_host8, 2), "overlapped_ms": round(t_both, 2),
          "host_hidden_share": round((t_fwd + t_host8 - t_both) / t_host8, 3), "threads": torch.get_num_threads()})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="decode")
    parser.add_argument("--model-dir", default=None, help="where the random model is kept (default: a temp dir)")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0, help="decode part: top_p of every request")
    parser.add_argument("--logprobs-rows", type=int, default=0,
                        help="decode part: this many of the requests also ask for logprobs (their rows need logits)")
    parser.add_argument("--max-num-batched-tokens", type=int, help="tokens per step (default: the engine's)")
    parser.add_argument("--budgets", default="512,2048,4096,8192")
    args = parser.parse_args()
    smollm2 = None
    if "structured" in args.parts:
        from engine.model.fetch import default_model_dir

        smollm2 = default_model_dir()
    with tempfile.TemporaryDirectory() as tmp:
        model = str(tiny_model(Path(args.model_dir or tmp), smollm2))
        for part in args.parts.split(","):
            {"decode": decode, "structured": structured, "budget": budget, "overlap": overlap}[part](model, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
