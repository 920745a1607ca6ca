"""Random-weight Llama checkpoints for benchmarks and checks on machines that cannot download.

``smollm2``: SmolLM2-135M's exact shape (30 layers, hidden 576, 9/3 heads of 64, vocab 49152,
tied embeddings): the same work per token as the real model, for speed figures. ``decisive``: a
small Llama (4 layers, hidden 512, 8/2 heads of 64) with large initial weights, so greedy
decoding has clear winners and a token-for-token comparison is meaningful.

    python benchmarks/helpers/random_model.py --shape smollm2 --out /tmp/smollm2-random
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

SHAPES: dict[str, dict[str, Any]] = {
    "smollm2": {
        "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "max_position_embeddings": 8192,
        "rope_theta": 100000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
        "bos_token_id": 1, "eos_token_id": 2,
    },
    "decisive": {
        "vocab_size": 512, "hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 4,
        "num_attention_heads": 8, "num_key_value_heads": 2, "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5, "initializer_range": 0.2, "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2,
    },
}


def make_random_model(out: Path, shape: str, seed: int = 0) -> Path:
    """Write a seeded random HF Llama checkpoint (config + safetensors, no tokenizer) into ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    if (out / "config.json").is_file():
        return out
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**SHAPES[shape]), dtype=torch.float32)
    model.save_pretrained(str(out))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(make_random_model(args.out, args.shape, args.seed))


if __name__ == "__main__":
    main()
