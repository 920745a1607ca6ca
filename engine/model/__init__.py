"""The Llama-family model on the paged KV cache, its loader, the model runner (a scheduled
batch → flattened tensors → hidden states and the model's head), KV-cache allocation and sizing, and the default-model
fetch.

May import torch, transformers and `ops`; never the scheduler, the block manager or the
worker. Names are imported lazily so `pagedserve fetch-model` (engine.model.fetch) and the
planner (engine.model.spec) do not pull in torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "AttentionMetadata": "engine.model.attention",
    "LlamaForCausalLM": "engine.model.llama",
    "ModelLoadError": "engine.model.loader",
    "ModelSpec": "engine.model.spec",
    "UnsupportedModelError": "engine.model.spec",
    "allocate_kv_caches": "engine.model.kv_cache",
    "kv_bytes_per_block": "engine.model.kv_cache",
    "kv_cache_shape": "engine.model.kv_cache",
    "load_hf_config": "engine.model.loader",
    "load_model": "engine.model.loader",
    "resolve_dtype": "engine.model.loader",
}

if TYPE_CHECKING:
    from engine.model.attention import AttentionMetadata
    from engine.model.kv_cache import allocate_kv_caches, kv_bytes_per_block, kv_cache_shape
    from engine.model.llama import LlamaForCausalLM
    from engine.model.loader import ModelLoadError, load_hf_config, load_model, resolve_dtype
    from engine.model.spec import ModelSpec, UnsupportedModelError

__all__ = [
    "AttentionMetadata",
    "LlamaForCausalLM",
    "ModelLoadError",
    "ModelSpec",
    "UnsupportedModelError",
    "allocate_kv_caches",
    "kv_bytes_per_block",
    "kv_cache_shape",
    "load_hf_config",
    "load_model",
    "resolve_dtype",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine.model' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
