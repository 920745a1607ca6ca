"""The size ladder's rungs: real models' shapes (from their published ``config.json``), random weights.

Each rung names the transformers architecture and the GGUF architecture llama.cpp's converter
writes for it. Shapes only: a random model of a real shape reads and computes what the real one
does per token, which is what a speed figure needs. RoPE scaling (Llama 3's ``llama3`` factors) is
left out: it changes neither the bytes read nor the work per token.
"""

from __future__ import annotations

from dataclasses import dataclass
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
