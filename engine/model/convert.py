"""Convert a GGUF checkpoint into a plain fp32 Hugging Face directory (safetensors)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from common.log import get_logger

log = get_logger("convert")


def _clean_config(config: Any) -> Any:
    """Drop GGUF quantization leftovers so the saved directory loads as a plain model."""
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, attr):
            delattr(config, attr)
    return config


def _fix_generation(model: Any, tokenizer: Any) -> None:
    """Point generation at the chat end token (`<|im_end|>` for SmolLM2)."""
    eos = tokenizer.eos_token_id
    if eos is None:
        return
    model.config.eos_token_id = eos
    model.generation_config.eos_token_id = eos
    if tokenizer.bos_token_id is not None:
        model.config.bos_token_id = tokenizer.bos_token_id
        model.generation_config.bos_token_id = tokenizer.bos_token_id
    if tokenizer.pad_token_id is not None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id


class ConvertError(ValueError):
    """A GGUF that transformers' loader would turn into a different model than the file holds."""


def check_convertible(gguf: Path) -> None:
    """ConvertError unless transformers' GGUF config of `gguf` is the model pagedserve reads from it:
    the same `model_type` and rope (transformers' loader drops `rope_freqs.weight`, the scaling keys,
    and a `llama` file's experts; writing its config would save a different model without a word)."""
    from transformers import AutoConfig

    from engine.model.loader import load_hf_config

    ours = load_hf_config(gguf)
    theirs = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    rope = dict(getattr(ours, "rope_parameters", None) or {})
    if ours.model_type != theirs.model_type:
        raise ConvertError(f"{gguf.name} is a {ours.model_type} model; transformers reads it as {theirs.model_type}: "
                           "serve the .gguf itself")
    if "freq_factors" in rope:
        raise ConvertError(f"{gguf.name} carries rope_freqs.weight (per-frequency rope divisors, Llama 3.x); "
                           "a transformers directory cannot state them: serve the .gguf itself")
    if rope != dict(getattr(theirs, "rope_parameters", None) or {}):
        raise ConvertError(f"{gguf.name}'s rope ({rope}) is not what transformers' GGUF config states: "
                           "serve the .gguf itself")


def convert_gguf(gguf: Path, out: Path, progress: bool = True) -> Path:
    """Write `out` as an fp32 safetensors HF directory with tokenizer and chat template
    (ConvertError first when transformers would read a different model: `check_convertible`)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.model.loader import load_gguf

    check_convertible(gguf)
    started = time.monotonic()
    log.info("dequantizing", file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    loaded = load_gguf(gguf, torch.float32, progress)
    config = _clean_config(loaded.config)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"GGUF weights do not match the model: missing={missing} unexpected={unexpected}")
    del loaded
    _fix_generation(model, tokenizer)
    log.info("saving", path=str(out), seconds=round(time.monotonic() - started, 1))
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    log.info("converted", path=str(out), seconds=round(time.monotonic() - started, 1))
    return out
