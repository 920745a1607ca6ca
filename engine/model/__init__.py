"""The Llama-family model on the paged KV cache, its loader, and the default-model fetch."""

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
