"""The fused decoder ops in plain torch: RMSNorm (with residual add), SiLU-and-mul, rotary
embedding plus the K/V cache write, and the linear layer. Rounding to the model dtype happens
where HF Llama rounds, so these equal the unfused model code they replace."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ops.reference.cache import reshape_and_cache


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x^2) + eps))`` per row, the norm in fp32 then rounded to x's dtype."""
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    result = weight * normed
    if out is None:
        return result
    out.copy_(result)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: ``residual = x + residual``, then ``x = rms_norm(residual)``; returns ``(x, residual)``."""
    residual.add_(x)
    x.copy_(rms_norm(residual, weight, eps))
    return x, residual


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` for ``x [..., 2d]`` (the SwiGLU activation)."""
    gate, up = x.chunk(2, dim=-1)
    result = F.silu(gate) * up
    if out is None:
        return result
    out.copy_(result)
    return out


def rotary_embedding_and_cache(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos_sin: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Rotate ``query [T, H, D]`` and ``key [T, KVH, D]`` in place (half-split RoPE, fp32 math) by
    ``cos_sin[positions]`` (``[P, D]``: D/2 cosines then D/2 sines), then store key and value at
    ``slot_mapping`` unless the caches are empty."""
    cos, sin = cos_sin[positions].float().unsqueeze(1).chunk(2, dim=-1)  # [T, 1, D/2] each
    for x in (query, key):
        first, second = x.float().chunk(2, dim=-1)
        x.copy_(torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1))
    if key_cache.numel():
        reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias``, as ``nn.Linear``."""
    return F.linear(x, weight, bias)
