"""Per-layer paged KV cache tensors and their size arithmetic."""

from __future__ import annotations

from typing import Any

import torch

from engine.config import KV_CACHE_DTYPES
from engine.model.spec import ModelSpec, kv_dtype_bytes_per_token


def _spec(source: Any) -> ModelSpec:
    """A ModelSpec from a spec, one of our models, or a transformers config."""
    if isinstance(source, ModelSpec):
        return source
    if isinstance(getattr(source, "spec", None), ModelSpec):
        return source.spec
    return ModelSpec.from_hf_config(source)


def kv_dtype_name(dtype: torch.dtype) -> str:
    """The KV_CACHE_DTYPES name of a cache's torch dtype."""
    name = str(dtype).removeprefix("torch.")
    if name not in KV_CACHE_DTYPES[1:]:
        raise ValueError(f"no KV cache of dtype {name} (one of {', '.join(KV_CACHE_DTYPES[1:])})")
    return name


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's torch dtype: the model dtype for "auto", else the named one. A float cache holds
    the model dtype (the kernels read it as the query dtype), so a float name must equal it;
    int8 quantizes rows of any model dtype."""
    if kv_cache_dtype == "auto":
        return model_dtype
    dtype: torch.dtype = getattr(torch, kv_cache_dtype)
    if dtype != torch.int8 and dtype != model_dtype:
        raise ValueError(
            f"kv_cache_dtype {kv_cache_dtype} needs the model dtype {kv_cache_dtype} (the model runs in "
            f"{kv_dtype_name(model_dtype)}): use kv_cache_dtype auto or int8, or dtype {kv_cache_dtype}"
        )
    return dtype


def kv_cache_shape(source: Any, num_blocks: int, block_size: int,
                   dtype: torch.dtype | None = None) -> tuple[int, int, int, int]:
    """`[num_blocks, num_kv_heads, block_size, head_dim]`: one layer's key (or value) cache; int8
    rows are `head_dim + 2` bytes (the values, then their fp16 scale)."""
    spec = _spec(source)
    row = spec.head_dim + (2 if dtype == torch.int8 else 0)
    return (num_blocks, spec.num_kv_heads, block_size, row)


def kv_bytes_per_block(source: Any, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block over all layers, K and V, in a cache of ``dtype``."""
    spec = _spec(source)
    return block_size * kv_dtype_bytes_per_token(spec.num_layers, spec.num_kv_heads, spec.head_dim,
                                                 kv_dtype_name(dtype))


def allocate_kv_caches(
    source: Any, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Zeroed `(key_cache, value_cache)` per layer, each `kv_cache_shape(...)` of ``dtype``."""
    spec = _spec(source)
    shape = kv_cache_shape(spec, num_blocks, block_size, dtype)
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(spec.num_layers)
    ]
