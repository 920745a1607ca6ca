"""Quality of the quantized GGUF path against the same weights dequantized to fp32, JSON lines.

For each variant (quantized with int8 activations for decode rows and fp32 ones for prompt rows, the
float32 default; int8 for prompt rows too, `--int8-prompt-activations`; fp32 activations everywhere;
bf16 linears, `dtype bfloat16` (auto on a CPU with AVX512-BF16): prompt rows in bf16, on AMX tiles
also steps of 32+ rows outside deterministic mode, the passage's prefill among them)
against the fp32 model of the same weights (the fetched directory, which is the GGUF dequantized
by transformers): mean NLL per token on a fixed English passage (as one prefill, and teacher-forced one token
per step through the decode kernels), and greedy agreement over
``--new-tokens`` tokens from a few chat prompts (identical sequences, first divergence).

    python benchmarks/quality/quant_quality.py [--gguf FILE --reference DIR] [--new-tokens 32]
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch
import torch.nn.functional as F

from engine.model import AttentionMetadata, LlamaForCausalLM, allocate_kv_caches, load_model
from engine.model.execution_policy import ExecutionPolicy
from engine.model.packed_experts import PackedExperts
from engine.model.quant_linear import QuantLinear

PASSAGE = (
    "The lighthouse stood at the end of a long stone pier, and every evening the keeper climbed its "
    "spiral stairs to light the lamp. Ships passing in the night depended on that steady beam to find "
    "the harbour entrance and avoid the rocks hidden beneath the waves. In winter the storms were fierce, "
    "and salt spray reached the windows at the very top of the tower. The keeper kept a careful log of "
    "the weather, the passing vessels and the hours the lamp burned. Years later, when the light was "
    "automated, the old logbooks were collected by the town museum, where visitors can still read the "
    "neat handwriting and imagine the long, quiet nights by the sea."
)
PROMPTS = ("What is the capital of France?", "Write a short poem about the ocean.",
           "Explain why the sky is blue in two sentences.", "List three uses of a paperclip.")
BLOCK = 16


class Paged:
    """One sequence in a paged KV cache with contiguous blocks (slot = position)."""

    def __init__(self, model: LlamaForCausalLM, max_len: int) -> None:
        self.model, self.blocks = model, (max_len + BLOCK - 1) // BLOCK
        self.caches = allocate_kv_caches(model, self.blocks, BLOCK, torch.float32, "cpu")
        self.table = torch.arange(self.blocks, dtype=torch.int32)[None]
        self.length = 0

    def run(self, ids: list[int]) -> torch.Tensor:
        """Logits for `ids` appended to the sequence (a prefill, or one decode token)."""
        n, start = len(ids), self.length
        empty = torch.zeros((0, self.blocks), dtype=torch.int32)
        decode = start > 0 and n == 1
        meta = AttentionMetadata(
            slot_mapping=torch.arange(start, start + n), num_prefills=0 if decode else 1,
            num_prefill_tokens=0 if decode else n, prefill_query_start=[0] if decode else [0, n],
            prefill_context_lens=[] if decode else [start + n], prefill_block_tables=empty if decode else self.table,
            decode_block_tables=self.table if decode else empty,
            decode_context_lens=torch.tensor([start + 1] if decode else [], dtype=torch.int32),
        )
        hidden = self.model(torch.tensor(ids), torch.arange(start, start + n), self.caches, meta)
        self.length += n
        return self.model.compute_logits(hidden)


def mean_nll(model: LlamaForCausalLM, ids: list[int]) -> float:
    """Mean negative log-likelihood per predicted token of `ids`, one prefill."""
    logits = Paged(model, len(ids)).run(ids)
    return float(F.cross_entropy(logits[:-1], torch.tensor(ids[1:])))


def mean_nll_decode(model: LlamaForCausalLM, ids: list[int]) -> float:
    """The same NLL teacher-forced one token per step (every linear layer at one row: the decode kernels)."""
    paged = Paged(model, len(ids))
    logits = torch.cat([paged.run([t]) for t in ids[:-1]])
    return float(F.cross_entropy(logits, torch.tensor(ids[1:])))


def greedy(model: LlamaForCausalLM, prompt: list[int], new_tokens: int) -> list[int]:
    """`new_tokens` argmax tokens after `prompt`, decoding through the paged cache."""
    paged = Paged(model, len(prompt) + new_tokens)
    out = [int(paged.run(prompt)[-1].argmax())]
    while len(out) < new_tokens:
        out.append(int(paged.run(out[-1:])[-1].argmax()))
    return out


def set_int8_activations(model: LlamaForCausalLM, on: bool) -> None:
    """Int8 activations in the decoder layers and packed MoE experts (the lm_head keeps fp32 activations,
    as loaded)."""
    for module in model.model.modules():
        if isinstance(module, (QuantLinear, PackedExperts)):
            module.int8_activations = on


def compare(quant: LlamaForCausalLM, fp32: LlamaForCausalLM, passage: list[int], prompts: list[list[int]],
            new_tokens: int, fp32_runs: dict[str, Any]) -> dict[str, Any]:
    nll = mean_nll(quant, passage)
    nll_decode = mean_nll_decode(quant, passage)
    runs = [greedy(quant, p, new_tokens) for p in prompts]
    firsts = [next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), None)
              for x, y in zip(runs, fp32_runs["greedy"], strict=True)]
    same = sum(x == y for x, y in zip(runs, fp32_runs["greedy"], strict=True))
    tokens = sum(next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), len(x))
                 for x, y in zip(runs, fp32_runs["greedy"], strict=True))
    return {"nll": round(nll, 5), "nll_fp32": round(fp32_runs["nll"], 5),
            "nll_rel_diff_pct": round(100 * (nll - fp32_runs["nll"]) / fp32_runs["nll"], 3),
            "nll_decode": round(nll_decode, 5),
            "nll_decode_rel_diff_pct": round(100 * (nll_decode - fp32_runs["nll"]) / fp32_runs["nll"], 3),
            "greedy_identical": same, "greedy_sequences": len(runs), "first_divergence": firsts,
            "common_prefix_tokens": tokens, "greedy_tokens": len(runs) * new_tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", default=None, help="GGUF file (default: the fetched SmolLM2 Q4_1)")
    parser.add_argument("--reference", default=None, help="fp32 directory of the same weights (default: fetched)")
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from engine.model.fetch import GGUF_NAME, default_model_dir

    directory = default_model_dir(progress=False)
    gguf = args.gguf or str(directory / GGUF_NAME)
    reference = args.reference or str(directory)
    tokenizer = AutoTokenizer.from_pretrained(reference)
    passage = tokenizer(PASSAGE)["input_ids"]
    prompts = [list(tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=False)) for p in PROMPTS]
    with torch.inference_mode():
        fp32 = load_model(reference)
        fp32_runs = {"nll": mean_nll(fp32, passage), "greedy": [greedy(fp32, p, args.new_tokens) for p in prompts]}
        variants = {"int8_activations": (True, True, False), "int8_activations_and_prompts": (True, False, False),
                    "fp32_activations": (False, True, False), "bf16_linears": (True, True, True)}
        for variant, (int8, exact_prompt_rows, bf16) in variants.items():  # a model per policy
            quant = load_model(gguf, policy=ExecutionPolicy(exact_prompt_rows=exact_prompt_rows, bf16_linears=bf16))
            set_int8_activations(quant, int8)
            line = compare(quant, fp32, passage, prompts, args.new_tokens, fp32_runs)
            print(json.dumps({"variant": variant, "passage_tokens": len(passage), **line}), flush=True)


if __name__ == "__main__":
    main()
