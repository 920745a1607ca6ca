"""What one int8 activation scale per 256 values (llama.cpp's Q8_K, which the K-quant kernels would need
to finish a 256-weight block in integers) costs in quality against the kernels' one scale per 32, JSON lines.

The fp32 model of the default weights (real trained ones: SmolLM2-135M-Instruct, ``pagedserve
fetch-model``) in transformers, each ``nn.Linear``'s input rounded as the int8-activation kernels round
it (``d = max|x| / 127`` per block of ``B`` values, ``x_hat = d round(x / d)``), for ``B`` = 32 and 256,
and the lm_head's input too or not. Per variant: mean NLL per token on the fixed passage of
``benchmarks/quality/quant_quality.py`` (teacher-forced, one prefill), greedy agreement over
``--new-tokens`` tokens from its chat prompts against the unrounded model (identical sequences, first
divergence), and the relative error ``|x_hat - x| / |x|`` of the rounded inputs over the passage
(median and worst over the linears). The weights stay fp32, so only the activations' rounding differs.

    .venv/bin/python benchmarks/investigations/activation_blocks.py [--new-tokens 32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout's root: benchmarks.* importable
from benchmarks.quality.quant_quality import PASSAGE, PROMPTS
from ops.reference.quant import int8_activations


def round_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """``x [..., K]`` rounded per ``block`` values as the int8-activation kernels round per 32
    (``ops.reference.quant.int8_activations``), a last partial block where K is no multiple of ``block``
    (SmolLM2-135M's 576 = 2 x 256 + 64: zeros pad it, which leaves its max unchanged)."""
    k = x.shape[-1]
    padded = F.pad(x.float().reshape(-1, k), (0, -k % block))
    return int8_activations(padded, block)[:, :k].reshape(x.shape).to(x.dtype)


@contextmanager
def rounded_inputs(model: Any, block: int | None, lm_head: bool, errors: list[float]) -> Iterator[None]:
    """Every linear's input rounded per ``block`` (None: untouched) while inside; relative errors to ``errors``."""
    hooks = []

    def pre_hook(_module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        x = args[0]
        rounded = round_blocks(x, block) if block else x
        norm = float(x.float().norm())
        if norm > 0:
            errors.append(float((rounded - x).float().norm()) / norm)
        return (rounded, *args[1:])

    if block:
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and (lm_head or name != "lm_head"):
                hooks.append(module.register_forward_pre_hook(pre_hook))
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


def greedy(model: Any, tokenizer: Any, prompt: str, new_tokens: int) -> list[int]:
    """Greedy continuation token ids of one chat prompt."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)
    ids = tokenizer(text, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    return out[0, ids.shape[1]:].tolist()


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (None: identical)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.model.fetch import default_model_dir

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    torch.manual_seed(0)
    folder = str(default_model_dir(progress=False))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    ids = tokenizer(PASSAGE, return_tensors="pt").input_ids
    variants = [("fp32", None, False), ("per32", 32, False), ("per256", 256, False),
                ("per32_lm_head", 32, True), ("per256_lm_head", 256, True)]
    reference: list[list[int]] = []
    for name, block, lm_head in tqdm(variants, desc="variants"):
        errors: list[float] = []
        with torch.no_grad(), rounded_inputs(model, block, lm_head, errors):
            logits = model(ids).logits[0]
            nll = float(F.cross_entropy(logits[:-1], ids[0, 1:]))
            passage_errors = list(errors)
            seqs = [greedy(model, tokenizer, p, args.new_tokens) for p in PROMPTS]
        if not reference:
            reference = seqs
        divergences = [first_divergence(s, r) for s, r in zip(seqs, reference, strict=True)]
        line: dict[str, Any] = {"bench": "activation_blocks", "variant": name, "block": block, "lm_head": lm_head,
                                "nll": round(nll, 5), "identical": sum(d is None for d in divergences),
                                "prompts": len(PROMPTS), "first_divergence": divergences}
        if passage_errors:
            line["input_error_median"] = round(statistics.median(passage_errors), 5)
            line["input_error_max"] = round(max(passage_errors), 5)
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
