"""``paged_attention`` (decode) and ``paged_prefill_attention`` (varlen prefill): checks, then the
compiled kernel for the tensors' device (or the reference)."""

from __future__ import annotations

from functools import partial

import torch

from ops import reference
from ops.attention_rows import prefill_as_decode
from ops.build import cpu_ops, cuda_ops
from ops.checks import check_attention, check_decode_lengths, check_prefill_attention, check_prefill_lengths
from ops.checks_cuda import optin_smem_bytes, prefill_rows_per_warp
from ops.device_errors import raise_device_errors
from ops.policy import FASTEST, OpsPolicy


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    window: int = 0,
    sinks: torch.Tensor | None = None,
    *,
    policy: OpsPolicy = FASTEST,
) -> torch.Tensor:
    """Decode attention: one query token per sequence over its paged K/V.

    query ``[num_seqs, num_heads, head_size]``; caches ``[num_blocks, num_kv_heads, block_size,
    head_size]``; block_tables int32 ``[num_seqs, max_blocks]``; context_lens int32 ``[num_seqs]``.
    ``window`` > 0: a sliding window, the query (at ``context_len - 1``) sees only the last
    ``window`` tokens, itself included (positions ``p > context_len - 1 - window``, transformers'
    sliding mask); 0 or -1: its whole context. Table entries of blocks wholly before the window are
    never read. ``sinks`` (fp32 ``[num_heads]``, gpt-oss): a learned logit per head that joins each
    query's softmax denominator and carries no value (the weights sum to less than one); None: none.
    Returns ``out`` (allocated when not given), same shape and dtype as ``query``. ``policy``: kernels
    or the reference (:mod:`ops.policy`).
    """
    window = check_window(window)
    check_attention(query, key_cache, value_cache, block_tables, context_lens, out)
    check_sinks(sinks, query)
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if query.shape[0] == 0:
        return out
    if policy.reference:
        check_decode_lengths(key_cache, block_tables, context_lens)
        args = (query, key_cache, value_cache, block_tables, context_lens, scale, out)
        return reference.paged_attention(*args, window=window, sinks=sinks)
    if query.is_cuda:
        raise_device_errors()  # what an earlier kernel flagged (a host read, no sync)
    lib = cuda_ops() if query.is_cuda else cpu_ops()
    lib.paged_attention(
        out, query, key_cache, value_cache, block_tables.contiguous(), context_lens.contiguous(), float(scale),
        window, sinks,
    )
    return out


def check_sinks(sinks: torch.Tensor | None, query: torch.Tensor) -> None:
    """Attention sinks as the kernels take them: a contiguous fp32 ``[num_heads]`` tensor on the query's device."""
    if sinks is None:
        return
    if (sinks.dtype != torch.float32 or sinks.dim() != 1 or sinks.shape[0] != query.shape[1]
            or not sinks.is_contiguous() or sinks.device != query.device):
        raise ValueError(f"sinks must be a contiguous fp32 tensor of num_heads ({query.shape[1]}) values on "
                         f"{query.device}; got {sinks.dtype} {tuple(sinks.shape)} on {sinks.device}")


def check_window(window: int) -> int:
    """A sliding window argument as the kernels take it: tokens a query sees (> 0), or 0 for none
    (-1 also means none, as in transformers' configs)."""
    if isinstance(window, bool) or not isinstance(window, int) or window < -1:
        raise ValueError(f"window must be an int >= -1 (-1 or 0: no sliding window), got {window!r}")
    return max(window, 0)


def paged_prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    window: int = 0,
    sinks: torch.Tensor | None = None,
    *,
    policy: OpsPolicy = FASTEST,
) -> torch.Tensor:
    """Prefill attention of every sequence of a step in one call, K/V read from the paged cache.

    query ``[num_tokens, num_heads, head_size]``: sequence ``s`` owns rows
    ``query_start_loc[s] : query_start_loc[s + 1]`` (int32 ``[num_seqs + 1]``), the last ``q_len``
    tokens of its ``context_lens[s]`` (int32 ``[num_seqs]``): query ``i`` sits at position
    ``context_len - q_len + i`` and attends causally to keys ``0 ..`` that position, all read through
    ``block_tables[s]`` (so their K/V, this chunk's included, must already be in the cache). Covers
    whole prompts, later chunks of a chunked prefill and prompts whose prefix hit the prefix cache.
    ``window`` > 0: query ``i`` sees only positions ``p`` with ``q_pos - window < p <= q_pos``
    (``paged_attention``'s sliding window); ``sinks``: ``paged_attention``'s attention sinks.
    Returns ``out`` (allocated when not given). Under ``policy.fixed_order`` (CPU) each row is computed
    as ``paged_attention`` would decode it (:mod:`ops.attention_rows`).
    """
    window = check_window(window)
    check_prefill_attention(query, key_cache, value_cache, block_tables, query_start_loc, context_lens, out)
    check_sinks(sinks, query)
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if query.shape[0] == 0 or context_lens.shape[0] == 0:
        return out
    if policy.reference:
        check_prefill_lengths(query, key_cache, block_tables, query_start_loc, context_lens)
        args = (query, key_cache, value_cache, block_tables, query_start_loc, context_lens, scale, out)
        return reference.paged_prefill_attention(*args, window=window, sinks=sinks)
    index_args = (block_tables.contiguous(), query_start_loc.contiguous(), context_lens.contiguous(), float(scale),
                  window)
    if not query.is_cuda and policy.fixed_order:  # decode's per-row arithmetic (ops/attention_rows.py); pass
        # the decode op the same options (the window, the sinks) as this call
        decode = partial(paged_attention, window=window, sinks=sinks, policy=policy)
        return prefill_as_decode(decode, query, key_cache, value_cache, block_tables, query_start_loc, context_lens,
                                 scale, out)
    if not query.is_cuda:
        cpu_ops().paged_prefill_attention(out, query, key_cache, value_cache, *index_args, sinks)
        return out
    raise_device_errors()
    device = query.device
    rows = prefill_rows_per_warp(query.shape[2], optin_smem_bytes(device), torch.cuda.get_device_name(device))
    cuda_ops().paged_prefill_attention(out, query, key_cache, value_cache, *index_args, rows, sinks)
    return out
