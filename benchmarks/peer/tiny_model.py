"""SmolLM2's shape cut to 2 layers, random weights: a model whose step time is nearly all engine
overhead (scheduling, batching, sampling, Python), not matrix multiplies.

Same hidden size (576), heads (9 query, 3 KV, head 64), MLP (1536) and vocabulary (49152) as
SmolLM2-135M-Instruct, `num_hidden_layers=2`, seeded random init, saved as a Hugging Face
directory with SmolLM2's tokenizer files (both servers load it as they load SmolLM2). Built
once under the cache; a marker file makes it all-or-nothing."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch

MARKER = ".peer-complete"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
                   "special_tokens_map.json")


def tiny_model_dir(source: Path, cache: Path, layers: int = 2, seed: int = 0) -> Path:
    """The random `layers`-layer model with `source`'s shape and tokenizer, built on first use."""
    target = cache / f"{source.name}-{layers}layer-random-seed{seed}"
    if (target / MARKER).is_file():
        return target
    from transformers import AutoConfig, AutoModelForCausalLM

    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{target.name}.", dir=target.parent) as tmp:
        work = Path(tmp) / target.name
        config = AutoConfig.from_pretrained(str(source))
        config.num_hidden_layers = layers
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.save_pretrained(str(work))
        for name in TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copy2(source / name, work / name)
        (work / MARKER).write_text(json.dumps({"source": str(source), "layers": layers, "seed": seed}))
        if target.exists():
            shutil.rmtree(target)
        work.rename(target)
    return target
