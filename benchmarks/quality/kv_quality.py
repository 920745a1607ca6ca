"""What the KV cache dtype costs: accuracy through the paged engine, and decode attention speed.
One JSON line per configuration, then a summary line.

- nll: mean negative log-likelihood of SmolLM2 on a fixed English passage (below, ~400 tokens),
  from the engine's prompt logprobs with prefill chunked into 64-token steps, so every chunk after
  the first reads the earlier chunks' K/V back from the (possibly int8) cache;
- greedy: tokens of a few prompts against the fp32 model with an fp32 cache (identical, or the
  first position that differs);
- weights: the fp32 directory, and with `--weights fp32,q4_1` also the Q4_1 GGUF as `pagedserve up`
  serves it (int8 activations in the quantized GEMV) with each KV dtype: the combination behind
  `up`'s default KV dtype;
- decode: paged decode attention at SmolLM2's shape (9 heads, 3 KV heads, head 64, block 16),
  batch 32 x 512 tokens of context, fp32 cache against int8 cache (best of timed rounds).

    python benchmarks/quality/kv_quality.py [--model DIR] [--budget 1] [--weights fp32,q4_1]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import ops
from benchmarks.helpers.timing import best_seconds
from common.sampling_params import SamplingParams
from engine.llm import LLM
from engine.model.fetch import GGUF_NAME, default_model_dir
from ops.reference.kv_quant import quantize_rows

PASSAGE = (
    "The old harbour town wakes slowly in winter. Before the sun has cleared the hills, the bakers are "
    "already at work, and the smell of bread drifts down the narrow streets toward the water. Fishing "
    "boats that left in the dark come back one by one, their decks crowded with crates and nets, and "
    "the men who steer them call to each other across the quiet bay. On the quay, a woman in a green "
    "coat counts the crates as they are lifted ashore and writes the numbers in a small notebook that "
    "she keeps in her pocket. She has done this every morning for twenty years, and she says she can "
    "tell the weather of the coming week from the size of the catch.\n\n"
    "By nine o'clock the market square is full. Farmers from the valley set out their vegetables on "
    "wooden tables: potatoes still dusty from the field, cabbages as large as a child's head, onions "
    "tied in long braids. Children run between the stalls while their parents argue about prices, and "
    "an old man plays the same three songs on an accordion, hoping for a few coins. The church bell "
    "rings the hour, a little late as always, and nobody seems to mind.\n\n"
    "In the afternoon the wind rises and the sky turns the colour of slate. Shopkeepers pull their "
    "shutters halfway down, and the cafés fill with people who would rather talk than walk home in the "
    "rain. Conversations turn to the usual subjects: the price of fuel, the new road that the council "
    "has promised for years, the son of the schoolteacher who went to study in the capital and has not "
    "come back. When the rain finally arrives it is heavy and brief, and afterwards the streets shine "
    "under the lamps.\n\n"
    "Evening brings a different kind of quiet. The boats are tied up, the market tables are folded and "
    "stacked against the walls, and the only sounds are the water against the stones and a radio "
    "playing somewhere above a shop. Lights go out one window at a time. Tomorrow, before dawn, the "
    "bakers will light their ovens again, and the town will begin another ordinary day, much like the "
    "one before it and, most likely, much like the one after."
)
PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator keeps food cold, step by step.",
    "List five tips for learning a new language as an adult.",
    "What are the main differences between a river and a canal?",
]
CONFIGS = {"fp32": [("float32", "float32"), ("float32", "int8"), ("bfloat16", "bfloat16"), ("bfloat16", "int8")],
           "q4_1": [("auto", "auto"), ("auto", "int8")]}  # the GGUF as `up` serves it (fp32 model, int8 GEMV inputs)
NEW_TOKENS = 48


def passage_nll(llm: LLM, tokens: list[int]) -> float:
    """Mean -log p(token | previous tokens) over the passage after its first token."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    out = llm.generate([tokens], params)[0]
    logprobs = [entry["logprob"] for entry in out.prompt_logprobs or [] if entry is not None]
    assert len(logprobs) == len(tokens) - 1, (len(logprobs), len(tokens))
    return -sum(logprobs) / len(logprobs)


def greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


def quality(model: str, weights: list[str]) -> list[dict[str, Any]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    passage = list(tok.encode(PASSAGE))
    prompts = [list(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)) for p in PROMPTS]
    rows: list[dict[str, Any]] = []
    baseline: list[list[int]] = []
    configs = [(w, dtype, kv) for w in weights for dtype, kv in CONFIGS[w]]
    for w, dtype, kv in configs:
        path = model if w == "fp32" else str(Path(model) / GGUF_NAME)
        llm = LLM(path, tokenizer=model, dtype=dtype, kv_cache_dtype=kv, kv_cache_memory=256 << 20,
                  max_num_batched_tokens=64, enable_prefix_caching=False)
        nll = passage_nll(llm, passage)
        tokens = greedy(llm, prompts)
        baseline = baseline or tokens
        divergences = [first_divergence(a, b) for a, b in zip(tokens, baseline, strict=True)]
        caches = llm.engine.runner.kv_caches
        slots = caches[0][0].shape[0] * caches[0][0].shape[2]
        bytes_per_token = sum(k.nbytes + v.nbytes for k, v in caches) // slots
        rows.append({"weights": w, "dtype": dtype, "kv_cache_dtype": kv, "passage_tokens": len(passage),
                     "nll": round(nll, 5),
                     "bytes_per_token": bytes_per_token, "tokens_per_gib": 2**30 // bytes_per_token,
                     "greedy_identical": sum(d is None for d in divergences), "greedy_prompts": len(prompts),
                     "first_divergence": divergences})
        print(json.dumps(rows[-1]), flush=True)
        del llm
    return rows


def decode_speed(budget: float) -> dict[str, Any]:
    """Best seconds per decode attention call over fp32 and int8 caches of the same contents."""
    batch, context, heads, kv_heads, head, block = 32, 512, 9, 3, 64, 16
    blocks_per_seq = context // block
    gen = torch.Generator().manual_seed(0)
    key = torch.randn(batch * blocks_per_seq + 1, kv_heads, block, head, generator=gen)
    value = torch.randn(batch * blocks_per_seq + 1, kv_heads, block, head, generator=gen)
    tables = torch.randperm(batch * blocks_per_seq, generator=gen).view(batch, blocks_per_seq).to(torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32)
    query = torch.randn(batch, heads, head, generator=gen)
    key_q, value_q = quantize_rows(key), quantize_rows(value)
    out = torch.empty_like(query)
    seconds = best_seconds({
        "float32": lambda: ops.paged_attention(query, key, value, tables, lens, head**-0.5, out=out),
        "int8": lambda: ops.paged_attention(query, key_q, value_q, tables, lens, head**-0.5, out=out),
    }, "cpu", budget)
    rows = batch * context * kv_heads * 2  # K and V rows read per call
    kv_bytes = {"float32": rows * head * 4, "int8": rows * (head + 2)}
    return {"decode": f"batch {batch} x {context} tokens, heads {heads}/{kv_heads}, head {head}, block {block}",
            **{f"{k}_us": round(v * 1e6, 1) for k, v in seconds.items()},
            **{f"{k}_gbps": round(kv_bytes[k] / v / 1e9, 2) for k, v in seconds.items()},
            "int8_over_float32_time": round(seconds["int8"] / seconds["float32"], 3)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--budget", type=float, default=1.0, help="seconds of timing per decode variant")
    parser.add_argument("--skip-quality", action="store_true")
    parser.add_argument("--weights", default="fp32", help="comma-separated: fp32 (the directory), q4_1 (its GGUF)")
    args = parser.parse_args()
    weights = [w.strip() for w in args.weights.split(",") if w.strip()]
    rows = [] if args.skip_quality else quality(args.model or str(default_model_dir(progress=True)), weights)
    speed = decode_speed(args.budget)
    print(json.dumps(speed), flush=True)
    if rows:
        ref = {(r["weights"], r["dtype"]): r["nll"] for r in rows if r["kv_cache_dtype"] != "int8"}
        fp32 = rows[0]["nll"]  # the fp32 directory with an fp32 cache, or the first row asked for
        summary = {f"{r['weights']}_{r['dtype']}_int8_nll_rel":
                   round(r["nll"] / ref[(r["weights"], r["dtype"])] - 1, 5)
                   for r in rows if r["kv_cache_dtype"] == "int8"}
        summary |= {f"{r['weights']}_{r['dtype']}_{r['kv_cache_dtype']}_nll_rel_to_first":
                    round(r["nll"] / fp32 - 1, 5) for r in rows[1:]}
        print(json.dumps({"summary": summary, "within_1pct": all(abs(v) < 0.01 for v in summary.values())}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
