"""Argument checks of the fused decoder ops and the linear layer (attribute checks only: these run
several times per layer per step, so they never touch tensor data)."""

from __future__ import annotations

import torch

from ops.checks import FLOAT_DTYPES, _dtype, _ndim, _same_device, cache_pair_ok, check_cache_write, holds


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
    if (x.dim() == 2 and x.dtype in FLOAT_DTYPES and x.stride(1) == 1 and weight.dim() == 1
            and weight.shape[0] == x.shape[1] and weight.dtype == x.dtype and weight.is_contiguous()
            and weight.device == x.device
            and all(o is None or (o.shape == x.shape and o.dtype == x.dtype and o.device == x.device
                                  and o.stride(1) == 1) for o in (residual, out))):
        return  # the common case in one expression (this runs twice per layer per step)
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
    if out is None and x.dim() == 2 and x.dtype in FLOAT_DTYPES and x.stride(1) == 1 and x.shape[1] % 2 == 0:
        return
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
    if (positions.dim() == 1 and positions.dtype == torch.int64 and query.dim() == 3 and key.dim() == 3
            and value.dim() == 3 and query.dtype in FLOAT_DTYPES and key.dtype == value.dtype == query.dtype
            and positions.shape[0] == query.shape[0] == key.shape[0] == value.shape[0]
            and query.shape[2] == key.shape[2] == value.shape[2] == cos_sin.shape[1] and query.shape[2] % 2 == 0
            and key.shape[1] == value.shape[1] and query.stride(2) == key.stride(2) == value.stride(2) == 1
            and cos_sin.dim() == 2 and cos_sin.dtype == torch.float32 and cos_sin.is_contiguous()
            and positions.device == query.device == key.device == value.device == cos_sin.device
            and (key_cache.numel() == 0 or (
                cache_pair_ok(key_cache, value_cache) and holds(key_cache, query.dtype, key.shape[2])
                and key_cache.shape[1] == key.shape[1]
                and slot_mapping.dim() == 1 and slot_mapping.dtype == torch.int64
                and slot_mapping.shape[0] == key.shape[0] and slot_mapping.device == key.device
                and key_cache.device == key.device))):
        return  # the common case in one expression (this runs once per layer per step)
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
    if (weight.dim() == 2 and x.shape[-1] == weight.shape[1] and x.dtype == weight.dtype
            and x.device == weight.device and (bias is None or (
                bias.dim() == 1 and bias.shape[0] == weight.shape[0] and bias.dtype == weight.dtype))):
        return
    _ndim("weight", weight, 2, "[out_features, in_features]")
    if x.shape[-1] != weight.shape[1] or x.dtype != weight.dtype:
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} does not fit weight {tuple(weight.shape)} {weight.dtype}")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != weight.dtype):
        raise ValueError(f"bias must be [{weight.shape[0]}] {weight.dtype}; got {tuple(bias.shape)} {bias.dtype}")
    _same_device(x=x, weight=weight)
