"""Argument checks of the fused decoder ops and the linear layer (attribute checks only: these run
several times per layer per step, so they never touch tensor data)."""

from __future__ import annotations

import torch

from ops.checks import FLOAT_DTYPES, _dtype, _ndim, _same_device, check_cache_write


def _rows(name: str, tensor: torch.Tensor) -> None:
    _ndim(name, tensor, 2, "[num_tokens, hidden]")
    _dtype(name, tensor, FLOAT_DTYPES)
    if tensor.stride(1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension")


def _like(name: str, tensor: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if tensor.shape != ref.shape or tensor.dtype != ref.dtype or tensor.device != ref.device:
        raise ValueError(
            f"{name} {tuple(tensor.shape)} {tensor.dtype} on {tensor.device} must match {ref_name} "
            f"{tuple(ref.shape)} {ref.dtype} on {ref.device}"
        )


def check_rms_norm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None,
                   out: torch.Tensor | None) -> None:
    """x ``[T, hidden]``; weight ``[hidden]`` of x's dtype; residual and out shaped like x."""
    _rows("x", x)
    if weight.shape != (x.shape[1],) or weight.dtype != x.dtype or not weight.is_contiguous():
        raise ValueError(f"weight must be a contiguous [{x.shape[1]}] {x.dtype} tensor; got "
                         f"{tuple(weight.shape)} {weight.dtype}")
    _same_device(x=x, weight=weight)
    for name, other in (("residual", residual), ("out", out)):
        if other is not None:
            _rows(name, other)
            _like(name, other, "x", x)


def check_silu_and_mul(x: torch.Tensor, out: torch.Tensor | None) -> None:
    """x ``[T, 2d]``; out ``[T, d]`` of x's dtype."""
    _rows("x", x)
    if x.shape[1] % 2:
        raise ValueError(f"x must have an even last dimension (gate then up); got {tuple(x.shape)}")
    if out is not None:
        _rows("out", out)
        if out.shape != (x.shape[0], x.shape[1] // 2) or out.dtype != x.dtype or out.device != x.device:
            raise ValueError(f"out must be [{x.shape[0]}, {x.shape[1] // 2}] {x.dtype} on {x.device}; "
                             f"got {tuple(out.shape)} {out.dtype} on {out.device}")


def check_rotary(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos_sin: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """positions int64 ``[T]``; query ``[T, H, D]``, key/value ``[T, KVH, D]``; cos_sin fp32 ``[P, D]``."""
    _ndim("positions", positions, 1, "[num_tokens]")
    _dtype("positions", positions, (torch.int64,))
    _ndim("query", query, 3, "[num_tokens, num_heads, head_size]")
    _dtype("query", query, FLOAT_DTYPES)
    num_tokens, _, head_size = query.shape
    for name, t in (("key", key), ("value", value)):
        _ndim(name, t, 3, "[num_tokens, num_kv_heads, head_size]")
        if t.shape[0] != num_tokens or t.shape[2] != head_size or t.dtype != query.dtype:
            raise ValueError(f"{name} {tuple(t.shape)} {t.dtype} must be [{num_tokens}, *, {head_size}] {query.dtype}")
    if key.shape[1] != value.shape[1]:
        raise ValueError(f"key and value differ in heads: {tuple(key.shape)} vs {tuple(value.shape)}")
    if query.stride(2) != 1 or key.stride(2) != 1 or value.stride(2) != 1:
        raise ValueError("query, key and value must be contiguous in their last (head_size) dimension")
    if positions.shape[0] != num_tokens:
        raise ValueError(f"positions ({positions.shape[0]}) and query ({num_tokens}) differ in tokens")
    _ndim("cos_sin", cos_sin, 2, "[max_positions, head_size] (cos then sin)")
    _dtype("cos_sin", cos_sin, (torch.float32,))
    if cos_sin.shape[1] != head_size or head_size % 2 or not cos_sin.is_contiguous():
        raise ValueError(f"cos_sin must be a contiguous [*, {head_size}] table; got {tuple(cos_sin.shape)}")
    _same_device(positions=positions, query=query, key=key, cos_sin=cos_sin)
    if key_cache.numel():
        check_cache_write(key, value, key_cache, value_cache, slot_mapping)


def check_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """x ``[..., K]``; weight ``[N, K]``; bias ``[N]``; one dtype, one device."""
    _ndim("weight", weight, 2, "[out_features, in_features]")
    if x.shape[-1] != weight.shape[1] or x.dtype != weight.dtype:
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} does not fit weight {tuple(weight.shape)} {weight.dtype}")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != weight.dtype):
        raise ValueError(f"bias must be [{weight.shape[0]}] {weight.dtype}; got {tuple(bias.shape)} {bias.dtype}")
    _same_device(x=x, weight=weight)
