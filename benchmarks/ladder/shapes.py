"""The size ladder's rungs: real models' shapes (from their published ``config.json``), random weights.

Each rung names the transformers architecture and the GGUF architecture llama.cpp's converter
writes for it. Shapes only: a random model of a real shape reads and computes what the real one
does per token, which is what a speed figure needs. RoPE scaling (Llama 3's ``llama3`` factors) is
left out: it changes neither the bytes read nor the work per token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Rung:
    """One model shape of the ladder."""

    name: str
    hf_arch: str  # transformers' model_type
    gguf_arch: str  # llama.cpp's architecture name
    config: dict[str, Any]
    qkv_bias: bool = False

    @property
    def params(self) -> int:
        """Parameters, embeddings included once (tied) or twice."""
        c = self.config
        hidden, inter, layers, vocab = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
        head = hidden // c["num_attention_heads"]
        kv = c["num_key_value_heads"] * head
        per_layer = hidden * (hidden + 2 * kv) + hidden * hidden + 3 * hidden * inter + 2 * hidden
        if self.qkv_bias:
            per_layer += hidden + 2 * kv
        embeddings = vocab * hidden * (1 if c.get("tie_word_embeddings") else 2)
        return layers * per_layer + embeddings + hidden


def _llama(hidden: int, inter: int, layers: int, heads: int, kv_heads: int, vocab: int, tied: bool,
           theta: float, eps: float = 1e-5) -> dict[str, Any]:
    return {"hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv_heads, "vocab_size": vocab,
            "tie_word_embeddings": tied, "rope_theta": theta, "rms_norm_eps": eps,
            "max_position_embeddings": 8192, "bos_token_id": 1, "eos_token_id": 2}


RUNGS: dict[str, Rung] = {r.name: r for r in (
    # Qwen/Qwen2.5-0.5B-Instruct: q/k/v carry biases
    Rung("qwen2.5-0.5b", "qwen2", "qwen2", _llama(896, 4864, 24, 14, 2, 151936, True, 1e6, 1e-6), qkv_bias=True),
    # HuggingFaceTB/SmolLM2-1.7B-Instruct
    Rung("smollm2-1.7b", "llama", "llama", _llama(2048, 8192, 24, 32, 32, 49152, True, 130000.0)),
    # meta-llama/Llama-3.2-3B-Instruct (GQA 24/8)
    Rung("llama3.2-3b", "llama", "llama", _llama(3072, 8192, 28, 24, 8, 128256, True, 500000.0)),
    # meta-llama/Llama-3.1-8B-Instruct (untied lm_head)
    Rung("llama3.1-8b", "llama", "llama", _llama(4096, 14336, 32, 32, 8, 128256, False, 500000.0)),
)}

# What llama.cpp's users download, and what its quantizer makes from the F16 file.
FORMATS = ("Q4_K_M", "Q4_0", "Q8_0")

# transformers' model_type -> (the architecture the HF folder is written as, llama.cpp's, q/k/v biases).
# Mistral's converter output is a Llama GGUF; its sliding window (where set) is left out, as RoPE
# scaling is: at the ladder's 64 + 16 positions it changes no read and no work.
CONFIG_ARCHS: dict[str, tuple[str, str, bool]] = {
    "llama": ("llama", "llama", False),
    "mistral": ("llama", "llama", False),
    "qwen2": ("qwen2", "qwen2", True),
}


def rung_from_config(path: Path, name: str | None = None) -> Rung:
    """A rung of any model's shape from its ``config.json`` (a Llama, Mistral or Qwen2 decoder), so
    the ladder runs shapes beyond its own four; named after the file's folder unless `name`."""
    config = json.loads(Path(path).read_text())
    model_type = config.get("model_type")
    if model_type not in CONFIG_ARCHS:
        raise ValueError(f"{path}: model_type {model_type!r} is not one the ladder writes "
                         f"(one of {', '.join(sorted(CONFIG_ARCHS))})")
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    head_dim = config.get("head_dim")
    if head_dim is not None and int(head_dim) * heads != hidden:
        raise ValueError(f"{path}: head_dim {head_dim} x {heads} heads != hidden_size {hidden}; "
                         "the ladder's files have head_dim = hidden_size / heads")
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise ValueError(f"{path}: attention or MLP biases beyond Qwen2's q/k/v are not written by the ladder")
    hf_arch, gguf_arch, bias = CONFIG_ARCHS[model_type]
    theta = config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta") or 10000.0
    shape = _llama(hidden, int(config["intermediate_size"]), int(config["num_hidden_layers"]), heads,
                   int(config.get("num_key_value_heads") or heads), int(config["vocab_size"]),
                   bool(config.get("tie_word_embeddings", False)), float(theta),
                   float(config.get("rms_norm_eps", 1e-6)))
    return Rung(name or Path(path).resolve().parent.name, hf_arch, gguf_arch, shape, qkv_bias=bias)


def resolve_rung(spec: str) -> Rung:
    """A rung by its ladder name, or from a ``config.json`` path (`rung_from_config`)."""
    if spec in RUNGS:
        return RUNGS[spec]
    if Path(spec).is_file():
        return rung_from_config(Path(spec))
    raise ValueError(f"{spec!r} is neither a rung ({', '.join(RUNGS)}) nor a config.json file")
