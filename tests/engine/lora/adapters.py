"""Random PEFT LoRA adapters for the tiny test models, written by PEFT itself (`save_pretrained`),
and HF + PEFT's fp32 greedy generation with one of them: the oracle of the LoRA tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(model_dir: Path, out: Path, seed: int, r: int = 8, alpha: int = 16,
                 targets: list[str] | None = None, **options: Any) -> Path:
    """A LoRA adapter of `model_dir` saved in `out`: PEFT's LoraConfig over `targets` (default all
    seven projections), lora_A as PEFT draws it and lora_B (zeros at init) random, both seeded,
    large enough that the adapter changes greedy tokens."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets or ALL_TARGETS, lora_dropout=0.0, **options)
    torch.manual_seed(seed)
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.normal_(0.0, 0.3 if "lora_B" in name else 0.2)
    model.save_pretrained(str(out))
    return out


def hf_greedy(model_dir: Path, adapter: Path | None, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers' fp32 greedy tokens for `prompt`, with the PEFT adapter at `adapter` applied."""
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter))
    model.eval()
    model.generation_config.eos_token_id = None  # the engine's side runs with ignore_eos
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                             do_sample=False, pad_token_id=0)
    return [int(t) for t in out[0, len(prompt):]]
