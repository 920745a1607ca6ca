"""Cache ops in plain torch: write new K/V into slots, copy blocks, swap blocks across devices."""

from __future__ import annotations

import torch

from ops.reference.kv_quant import to_cache


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write each token's K/V ``[T, kv_heads, head]`` into its slot (quantized for an int8 cache, see
    ``kv_quant``); slots < 0 are skipped."""
    block_size = key_cache.shape[2]
    slots = slot_mapping.to(device=key.device, dtype=torch.int64)
    keep = slots >= 0
    slots = slots[keep]
    blocks, offsets = slots // block_size, slots % block_size
    key_cache[blocks, :, offsets] = to_cache(key[keep], key_cache.dtype)
    value_cache[blocks, :, offsets] = to_cache(value[keep], value_cache.dtype)


def copy_blocks(
    key_caches: list[torch.Tensor],
    value_caches: list[torch.Tensor],
    block_mapping: torch.Tensor,
) -> None:
    """For every layer, copy block ``src`` onto block ``dst`` for each (src, dst) row."""
    if block_mapping.numel() == 0:
        return
    mapping = block_mapping.to(torch.int64)
    for cache in (*key_caches, *value_caches):
        pairs = mapping.to(cache.device)
        cache[pairs[:, 1]] = cache[pairs[:, 0]]


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Copy blocks of one cache tensor across devices: ``dst[d] = src[s]`` for each (s, d) row."""
    if block_mapping.numel() == 0:
        return
    mapping = block_mapping.to(torch.int64)
    gathered = src[mapping[:, 0].to(src.device)].to(dst.device, non_blocking=False)
    dst[mapping[:, 1].to(dst.device)] = gathered
