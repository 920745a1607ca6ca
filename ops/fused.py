"""Fused decoder ops: RMSNorm (plain and with the residual add, in place), SiLU-and-mul, and rotary
embedding fused with the K/V cache write. Checks, then the kernel for the device (or the reference
under ``policy.reference``)."""

from __future__ import annotations

from typing import Any

import torch

from ops import reference
from ops.build import cpu_ops, cuda_ops
from ops.checks_fused import check_rms_norm, check_rotary, check_silu_and_mul
from ops.device_errors import raise_device_errors
from ops.policy import FASTEST, OpsPolicy


def _lib(tensor: torch.Tensor) -> Any:
    return cuda_ops() if tensor.is_cuda else cpu_ops()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None, *,
             policy: OpsPolicy = FASTEST) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)`` per row of ``x [T, hidden]`` (fp32 math)."""
    check_rms_norm(x, weight, None, out)
    if policy.reference:
        return reference.rms_norm(x, weight, eps, out)
    if out is None:
        out = torch.empty_like(x)
    if x.shape[0]:
        _lib(x).rms_norm(out, x, weight, float(eps))
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *, policy: OpsPolicy = FASTEST
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: ``residual += x``, then ``x = rms_norm(residual)``. Returns ``(x, residual)``: the
    normed input of the next block and the residual stream (the contract of layers.RMSNorm)."""
    check_rms_norm(x, weight, residual, None)
    if policy.reference:
        return reference.fused_add_rms_norm(x, residual, weight, eps)
    if x.shape[0]:
        _lib(x).fused_add_rms_norm(x, residual, weight, float(eps))
    return x, residual


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None, *, policy: OpsPolicy = FASTEST) -> torch.Tensor:
    """``silu(gate) * up`` for ``x = [gate | up]`` of shape ``[T, 2d]``; returns ``[T, d]``."""
    check_silu_and_mul(x, out)
    if policy.reference:
        return reference.silu_and_mul(x, out)
    if out is None:
        out = x.new_empty((x.shape[0], x.shape[1] // 2))
    if x.shape[0]:
        _lib(x).silu_and_mul(out, x)
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
    *,
    policy: OpsPolicy = FASTEST,
) -> None:
    """Rotate ``query [T, H, D]`` and ``key [T, KVH, D]`` in place by ``cos_sin[positions]`` (fp32
    ``[P, D]``: the D/2 cosines then the D/2 sines of the half-split RoPE of HF Llama, any scaling
    variant already folded in), then write key and value into the paged caches at ``slot_mapping``
    (int64, < 0 skipped) in the same pass. Empty caches (a profiling pass) skip the write."""
    check_rotary(positions, query, key, value, cos_sin, key_cache, value_cache, slot_mapping)
    if positions.shape[0] == 0:
        return
    if policy.reference:
        reference.rotary_embedding_and_cache(positions, query, key, value, cos_sin, key_cache, value_cache,
                                             slot_mapping)
        return
    if query.is_cuda:
        raise_device_errors()
    # the kernels read positions and slots at stride 1
    _lib(query).rotary_embedding_and_cache(positions.contiguous(), query, key, value, cos_sin, key_cache,
                                           value_cache, slot_mapping.contiguous())
