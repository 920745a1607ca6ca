"""``paged_attention``: checks, then the compiled kernel for the tensors' device (or the reference)."""

from __future__ import annotations

import torch

from ops import reference
from ops.backend import use_reference
from ops.build import cpu_ops, cuda_ops
from ops.checks import check_attention


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention: one query token per sequence over its paged K/V.

    query ``[num_seqs, num_heads, head_size]``; caches ``[num_blocks, num_kv_heads, block_size,
    head_size]``; block_tables int32 ``[num_seqs, max_blocks]``; context_lens int32 ``[num_seqs]``.
    Returns ``out`` (allocated when not given), same shape and dtype as ``query``.
    """
    check_attention(query, key_cache, value_cache, block_tables, context_lens, out)
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if query.shape[0] == 0:
        return out
    if use_reference():
        args = (query, key_cache, value_cache, block_tables, context_lens, scale, out)
        return reference.paged_attention(*args)
    lib = cuda_ops() if query.is_cuda else cpu_ops()
    lib.paged_attention(
        out, query, key_cache, value_cache, block_tables.contiguous(), context_lens.contiguous(), float(scale)
    )
    return out
