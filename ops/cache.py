"""Cache ops: ``reshape_and_cache``, ``copy_blocks``, ``swap_blocks`` with checks and dispatch
(kernels, or the reference under ``policy.reference``: :mod:`ops.policy`)."""

from __future__ import annotations

from typing import Any

import torch

from ops import reference
from ops.build import cpu_ops, cuda_ops
from ops.checks import check_cache_write, check_copy, check_swap
from ops.checks_cuda import check_mapping_range, check_same_geometry
from ops.device_errors import raise_device_errors
from ops.policy import FASTEST, OpsPolicy


def _lib(*tensors: torch.Tensor) -> Any:
    return cuda_ops() if any(t.is_cuda for t in tensors) else cpu_ops()


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    policy: OpsPolicy = FASTEST,
) -> None:
    """Store each token's K/V ``[T, kv_heads, head]`` at ``slot_mapping[T]`` (int64); slots < 0 skipped."""
    check_cache_write(key, value, key_cache, value_cache, slot_mapping)
    if key.shape[0] == 0:
        return
    if policy.reference:
        reference.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
        return
    if key_cache.is_cuda:
        raise_device_errors()
    _lib(key_cache).reshape_and_cache(key, value, key_cache, value_cache, slot_mapping.contiguous())


def copy_blocks(
    key_caches: list[torch.Tensor],
    value_caches: list[torch.Tensor],
    block_mapping: torch.Tensor,
    *,
    policy: OpsPolicy = FASTEST,
) -> None:
    """Copy block ``src`` onto ``dst`` in every layer's caches, for each int64 (src, dst) row."""
    check_copy(key_caches, value_caches, block_mapping)
    if block_mapping.shape[0] == 0 or not key_caches:
        return
    check_mapping_range(block_mapping, key_caches[0].shape[0], key_caches[0].shape[0], "copy_blocks")
    if key_caches[0].is_cuda:
        check_same_geometry([*key_caches, *value_caches])
    if policy.reference:
        reference.copy_blocks(key_caches, value_caches, block_mapping)
        return
    mapping = block_mapping.to(key_caches[0].device, non_blocking=True).contiguous()
    _lib(key_caches[0]).copy_blocks(list(key_caches), list(value_caches), mapping)


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor, *,
                policy: OpsPolicy = FASTEST) -> None:
    """Copy blocks of one cache between device and host: ``dst[d] = src[s]`` for each (s, d) row.

    ``block_mapping`` is int64 ``[n, 2]`` on the CPU. For asynchronous copies on CUDA the host
    tensor should be pinned (``pin_memory()``); the copy runs on the current stream.
    """
    check_swap(src, dst, block_mapping)
    if block_mapping.shape[0] == 0:
        return
    check_mapping_range(block_mapping, src.shape[0], dst.shape[0], "swap_blocks")
    if policy.reference:
        reference.swap_blocks(src, dst, block_mapping)
        return
    _lib(src, dst).swap_blocks(src, dst, block_mapping.contiguous())
