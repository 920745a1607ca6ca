"""Shared helpers for engine tests: HF greedy references and leak checks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from engine.llm import LLM

RAW_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there lived a",
    "List three colors:",
]
CHAT_PROMPTS = [
    "What is the boiling point of water at sea level?",
    "Write a haiku about memory pages.",
    "Explain, in two sentences, why the sky is blue. Keep it simple for a child who is seven years old.",
    "Hi!",
]


def smollm2_prompt_ids(model_dir: Path) -> list[list[int]]:
    """Four raw and four chat-templated prompts of different lengths, as token ids."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    raw = [list(tok.encode(p)) for p in RAW_PROMPTS]
    chat = [
        list(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                     tokenize=True, return_dict=False))
        for p in CHAT_PROMPTS
    ]
    return raw + chat


def argmax_greedy(model: Any, prompt: list[int], new_tokens: int) -> list[int]:
    """`new_tokens` greedy tokens of an in-memory transformers `model` after `prompt`: the whole
    sequence's forward per token, its last row's argmax (no cache, no generation config)."""
    tokens = list(prompt)
    with torch.inference_mode():
        for _ in range(new_tokens):
            tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt):]


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_new_tokens: int,
              dtype: torch.dtype = torch.float32) -> list[list[int]]:
    """Hugging Face generate(do_sample=False), one prompt at a time (no padding effects),
    exactly max_new_tokens tokens (EOS ignored) so every position is compared."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    model.eval()
    out = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                 pad_token_id=model.config.eos_token_id)
            out.append(gen[0, len(prompt):].tolist())
    return out


def assert_no_leaks(llm: LLM) -> None:
    """Every block back on the free list; no request left in any queue."""
    manager = llm.engine.block_manager
    manager.check_invariants()
    assert manager.num_used_blocks == 0, f"{manager.num_used_blocks} blocks still held"
    assert manager.num_free_cpu_blocks == manager.num_cpu_blocks
    assert not llm.engine.has_unfinished_requests()
    assert not llm.engine.requests


def generated(outputs: list[Any]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def hf_logits(directory: Path, tokens: list[int]) -> torch.Tensor:
    """HF transformers' fp32 logits `[len(tokens), vocab]` of the checkpoint in `directory`."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0]


def assert_bf16_within_hf_bf16(directory: Path, tokens: list[int]) -> None:
    """The paged model in bf16 (a 20-token prefill, then decodes) against HF fp32: mean |logit
    error| at most 1.5x that of HF's own bf16 (the bound of test_bf16_oracle)."""
    from transformers import AutoModelForCausalLM

    from engine.model.loader import load_model
    from tests.fixtures.models import PagedHarness, Seq

    truth = hf_logits(directory, tokens)
    hf = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.bfloat16).eval()
    with torch.no_grad():
        hf_bf16 = hf(torch.tensor([tokens])).logits[0].float()
    harness, seq = PagedHarness(load_model(directory, dtype="bfloat16"), seed=2), Seq(tokens)
    steps = len(tokens) - 20
    ours = torch.cat([harness.step([(seq, 20)], [])] + [harness.step([], [seq]) for _ in range(steps)]).float()
    assert (ours - truth).abs().mean() <= 1.5 * (hf_bf16 - truth).abs().mean()
