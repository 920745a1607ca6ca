"""Per-layer paged KV cache tensors and their size arithmetic."""

from __future__ import annotations

from typing import Any

import torch

from engine.model.spec import ModelSpec, kv_bytes_per_token


def _spec(source: Any) -> ModelSpec:
    """A ModelSpec from a spec, one of our models, or a transformers config."""
    if isinstance(source, ModelSpec):
        return source
    if isinstance(getattr(source, "spec", None), ModelSpec):
        return source.spec
    return ModelSpec.from_hf_config(source)


def kv_cache_shape(source: Any, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
    """`[num_blocks, num_kv_heads, block_size, head_dim]`: one layer's key (or value) cache."""
    spec = _spec(source)
    return (num_blocks, spec.num_kv_heads, block_size, spec.head_dim)


def kv_bytes_per_block(source: Any, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block over all layers, K and V."""
    spec = _spec(source)
    element = torch.empty((), dtype=dtype).element_size()
    return block_size * kv_bytes_per_token(spec.num_layers, spec.num_kv_heads, spec.head_dim, element)


def allocate_kv_caches(
    source: Any, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Zeroed `(key_cache, value_cache)` per layer, each `[num_blocks, kv_heads, block_size, head_dim]`."""
    spec = _spec(source)
    shape = kv_cache_shape(spec, num_blocks, block_size)
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(spec.num_layers)
    ]
