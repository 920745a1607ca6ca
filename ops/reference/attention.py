"""Paged attention in plain torch (decode and varlen prefill): slow, obviously correct, the oracle."""

from __future__ import annotations

import torch

from ops.reference.kv_quant import as_float, head_size_of

# Bound the gathered K/V of one chunk of sequences (elements, fp32) so long contexts fit in memory.
_MAX_GATHER_ELEMS = 1 << 26


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
) -> torch.Tensor:
    """Decode attention of one query token per sequence over its paged K/V (fp32 math); with
    ``window`` > 0 over its last ``window`` tokens only (query at ``len - 1`` sees ``p > len - 1 - window``);
    ``sinks [num_heads]``: each head's extra logit in the softmax denominator (no value), as
    transformers' gpt-oss computes it."""
    num_seqs, _, head_size = query.shape
    _, num_kv_heads, block_size, _ = key_cache.shape
    result = out if out is not None else torch.empty_like(query)
    if num_seqs == 0:
        return result
    lens = context_lens.to(device=query.device, dtype=torch.int64)
    max_blocks = max(1, (int(lens.max()) + block_size - 1) // block_size)
    per_seq = max_blocks * block_size * num_kv_heads * head_size * 2
    chunk = max(1, _MAX_GATHER_ELEMS // per_seq)
    for start in range(0, num_seqs, chunk):
        stop = min(num_seqs, start + chunk)
        result[start:stop] = _attend_chunk(
            query[start:stop], key_cache, value_cache, block_tables[start:stop, :max_blocks],
            lens[start:stop], scale, window, sinks,
        ).to(result.dtype)
    return result


def _attend_chunk(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    window: int,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    num_seqs, num_heads, head_size = query.shape
    _, num_kv_heads, block_size, _ = key_cache.shape
    group = num_heads // num_kv_heads
    max_blocks = block_tables.shape[1]
    max_len = max_blocks * block_size
    pos = torch.arange(max_len, device=query.device)
    valid = pos[None, :] < lens[:, None]  # [S, L]
    block_start = torch.arange(max_blocks, device=query.device)[None, :] * block_size
    # Table entries past a sequence's context (or wholly before its window) may hold anything:
    # never dereference them.
    needed = block_start < lens[:, None]
    if window > 0:
        first = lens[:, None] - window  # the window's first position
        valid &= pos[None, :] >= first
        needed &= block_start + block_size > first
    table = block_tables.to(torch.int64).masked_fill(~needed, 0)
    keys = _gather(key_cache, table)  # [S, kvh, L, D]
    # Slots past the context may hold stale data, even NaN: zero them so 0 * NaN never leaks.
    values = _gather(value_cache, table).masked_fill(~valid[:, None, :, None], 0.0)
    q = query.float().view(num_seqs, num_kv_heads, group, head_size)
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scale  # [S, kvh, g, L]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    if sinks is not None:
        probs = softmax_with_sinks(scores, sinks.float().view(1, num_kv_heads, group, 1))
    else:
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # empty context -> zeros
    return torch.matmul(probs, values).view(num_seqs, num_heads, head_size)


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim with one more logit, `sinks` (broadcast to `scores[..., :1]`), joined
    to it and dropped after: transformers' gpt-oss eager attention (max-shifted, the sink included)."""
    combined = torch.cat([scores, sinks.expand(*scores.shape[:-1], 1)], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    return torch.softmax(combined, dim=-1)[..., :-1]


def _gather(cache: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Gather ``[S, kv_heads, max_blocks * block_size, head]`` in fp32 from a paged cache (any dtype)."""
    num_seqs, max_blocks = table.shape
    _, num_kv_heads, block_size, _ = cache.shape
    head_size = head_size_of(cache)
    blocks = as_float(cache[table])  # [S, B, kvh, bs, D], int8 rows dequantized
    return blocks.permute(0, 2, 1, 3, 4).reshape(num_seqs, num_kv_heads, max_blocks * block_size, head_size)


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
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole paged context (fp32 math).

    Sequence ``s`` owns ``query[query_start_loc[s]:query_start_loc[s + 1]]``: the last ``q_len``
    tokens of its ``context_lens[s]``, so query ``i`` sits at position ``context_len - q_len + i``
    and sees keys ``0 ..`` that position, all read from the cache through ``block_tables[s]``;
    with ``window`` > 0 only keys ``p > q_pos - window`` of them (transformers' sliding mask);
    ``sinks``: ``paged_attention``'s.
    """
    result = out if out is not None else torch.empty_like(query)
    starts = query_start_loc.tolist()
    group = query.shape[1] // key_cache.shape[1]
    for s, context_len in enumerate(context_lens.tolist()):
        lo, hi = starts[s], starts[s + 1]
        if hi == lo:
            continue
        block_size = key_cache.shape[2]
        num_blocks = (context_len + block_size - 1) // block_size
        table = block_tables[s : s + 1, :num_blocks].to(torch.int64)
        first_seen = max(0, context_len - (hi - lo) - window + 1) if window > 0 else 0
        if first_seen:  # blocks wholly before the first query's window may hold anything: never read
            table = table.clone()
            table[:, : first_seen // block_size] = 0
        keys = _gather(key_cache, table)[0, :, :context_len]  # [kvh, ctx, D]
        values = _gather(value_cache, table)[0, :, :context_len]
        keys[:, :first_seen] = 0.0  # nor the slots before it in its first block (0 * NaN never leaks)
        values[:, :first_seen] = 0.0
        q = query[lo:hi].float().transpose(0, 1)  # [H, q, D]
        scores = q @ keys.repeat_interleave(group, 0).transpose(1, 2) * scale  # [H, q, ctx]
        q_pos = torch.arange(context_len - (hi - lo), context_len, device=query.device)
        key_pos = torch.arange(context_len, device=query.device)[None, :]
        visible = key_pos <= q_pos[:, None]
        if window > 0:
            visible &= key_pos > q_pos[:, None] - window
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            probs = softmax_with_sinks(scores, sinks.float().view(-1, 1, 1))
        else:
            probs = torch.softmax(scores, dim=-1)
        result[lo:hi] = (probs @ values.repeat_interleave(group, 0)).transpose(0, 1).to(result.dtype)
    return result
