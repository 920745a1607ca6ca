"""The int8 KV cache row format in plain torch: quantize on write, dequantize on read.

An int8 cache is ``[num_blocks, num_kv_heads, block_size, head_size + 2]`` (``torch.int8``): each
token row holds ``head_size`` int8 values, then its fp16 scale in the last 2 bytes (little endian).
Symmetric per (token, head): ``scale = fp16(absmax / 127)``, ``q = clamp(round_half_even(x / scale),
-127, 127)`` (``q = 0`` where the scale is 0), ``x' = q * scale`` in fp32. The kernels match this
bit for bit; the row stays one tensor per layer, so block copies and swaps are byte copies.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 2  # one fp16 scale per row
QMAX = 127.0


def is_quantized(cache: torch.Tensor) -> bool:
    """Whether ``cache`` is an int8 cache in the row format above."""
    return cache.dtype == torch.int8


def head_size_of(cache: torch.Tensor) -> int:
    """The head size a cache holds: its last dim, less the scale bytes for int8."""
    return cache.shape[-1] - SCALE_BYTES if is_quantized(cache) else cache.shape[-1]


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """int8 ``[..., D + 2]`` rows of ``x [..., D]`` (any float dtype)."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / QMAX).to(torch.float16)
    sf = scale.float()
    safe = torch.where(sf > 0, sf, torch.ones_like(sf))
    q = torch.round(xf / safe).clamp_(-QMAX, QMAX)
    q = torch.where(sf > 0, q, torch.zeros_like(q)).to(torch.int8)
    return torch.cat((q, scale.view(torch.int8)), dim=-1)


def dequantize_rows(rows: torch.Tensor) -> torch.Tensor:
    """fp32 ``[..., D]`` of int8 rows ``[..., D + 2]``."""
    q = rows[..., :-SCALE_BYTES]
    scale = rows[..., -SCALE_BYTES:].contiguous().view(torch.float16).float()
    return q.float() * scale


def as_float(cache_rows: torch.Tensor) -> torch.Tensor:
    """Cache rows (any cache dtype) as fp32 ``[..., head_size]``."""
    return dequantize_rows(cache_rows) if is_quantized(cache_rows) else cache_rows.float()


def to_cache(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """Rows of ``x [..., D]`` in the form a cache of ``cache_dtype`` stores them."""
    return quantize_rows(x) if cache_dtype == torch.int8 else x.to(cache_dtype)
