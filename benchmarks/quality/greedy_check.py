"""Greedy decoding through the engine against Hugging Face generate(), on any device and dtype.

Prints one JSON line: how many sequences are identical token for token, and how far the others
agree. In fp32 every sequence should be identical; in bf16/fp16 both sides round differently, so
divergence at a near-tie is expected and reported rather than failed. For those dtypes the line
also holds each side's logit error against fp32 HF (teacher-forced prompts): ours should be no
worse than HF's own in that dtype.

    python benchmarks/quality/greedy_check.py --device cuda --dtype bfloat16 [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout's root: benchmarks.* importable
from benchmarks.helpers.random_model import make_random_model
from common.sampling_params import SamplingParams
from engine.llm import LLM


def hf_greedy(model_dir: str, prompts: list[list[int]], new_tokens: int, device: str,
              dtype: torch.dtype) -> list[list[int]]:
    """HF generate() one prompt at a time (no padding), min_new_tokens so EOS cannot end it early."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    outs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=device)  # explicit mask: HF would mask pad-id tokens
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
            outs.append(gen[0, len(prompt):].tolist())
    return outs


def logit_errors(model_dir: str, prompts: list[list[int]], device: str, dtype: torch.dtype) -> dict[str, float]:
    """Mean |logit - fp32 HF logit| over every prompt position, for HF and for our model in `dtype`
    (our model runs one whole-prompt prefill through the paged kernels)."""
    from transformers import AutoModelForCausalLM

    from engine.model import AttentionMetadata, allocate_kv_caches, load_model

    hf32 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    ours = load_model(model_dir, dtype, device)
    block_size = 16
    errors = {"hf": 0.0, "ours": 0.0}
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor(prompt, device=device)
            truth = hf32(ids[None]).logits[0].float()
            n, blocks = len(prompt), (len(prompt) + block_size - 1) // block_size
            caches = allocate_kv_caches(ours, blocks, block_size, dtype, device)
            meta = AttentionMetadata(
                slot_mapping=torch.arange(n, device=device), num_prefills=1, num_prefill_tokens=n,
                prefill_query_start=[0, n], prefill_context_lens=[n],
                prefill_block_tables=torch.arange(blocks, dtype=torch.int32, device=device)[None],
                decode_block_tables=torch.zeros((0, 1), dtype=torch.int32, device=device),
                decode_context_lens=torch.zeros(0, dtype=torch.int32, device=device),
            )
            logits = ours.compute_logits(ours(ids, torch.arange(n, device=device), caches, meta))
            errors["ours"] += float((logits - truth).abs().mean()) / len(prompts)
            errors["hf"] += float((hf(ids[None]).logits[0].float() - truth).abs().mean()) / len(prompts)
    return {f"logit_err_vs_fp32_{k}": round(v, 5) for k, v in errors.items()}


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict[str, float | int]:
    """Identical sequences and the mean length of the common prefix."""
    prefixes = []
    for a, b in zip(ours, theirs, strict=True):
        n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        prefixes.append(n)
    return {"sequences": len(ours), "identical": sum(a == b for a, b in zip(ours, theirs, strict=True)),
            "mean_common_prefix": round(sum(prefixes) / len(prefixes), 1), "min_common_prefix": min(prefixes)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF directory (default: a random 'decisive' Llama)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--max-num-batched-tokens", type=int, help="small values chunk prefills (default: engine's)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(make_random_model(Path(tmp) / "decisive", "decisive"))
        vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, vocab, (int(n),), generator=gen).tolist()
                   for n in torch.randint(4, 200, (args.num_prompts,), generator=gen)]
        blocks = 4096 if args.device.startswith("cuda") else None  # not 90% of the card
        llm = LLM(model, device=args.device, dtype=args.dtype, kv_cache_memory=256 << 20, num_gpu_blocks=blocks,
                  max_num_batched_tokens=args.max_num_batched_tokens)
        params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, min_tokens=args.new_tokens)
        ours = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
        del llm
        theirs = hf_greedy(model, prompts, args.new_tokens, args.device, getattr(torch, args.dtype))
        errors = {} if args.dtype == "float32" else logit_errors(model, prompts, args.device,
                                                                 getattr(torch, args.dtype))
    print(json.dumps({"bench": "greedy_vs_hf", "model": args.model or "random-decisive", "device": args.device,
                      "dtype": args.dtype, **agreement(ours, theirs), **errors}), flush=True)


if __name__ == "__main__":
    main()
