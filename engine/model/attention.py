"""Paged attention layer: writes new K/V into the block cache, then attends prefill and decode tokens.

A step's tokens are flattened with prefill (chunk) tokens first, one decode token per sequence after.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import ops


@dataclass
class AttentionMetadata:
    """Where a step's tokens sit in the paged cache; built by the runner, shared by every layer."""

    slot_mapping: Tensor  # int64 [T]: cache slot of each new token's K/V (-1 = skip)
    num_prefills: int  # prefill sequences come first in the flattened batch
    num_prefill_tokens: int  # tokens [0, num_prefill_tokens) are prefill (chunk) tokens
    prefill_query_start: list[int]  # len num_prefills + 1, cumulative query-chunk lengths
    prefill_context_lens: list[int]  # per prefill seq: total KV length including this chunk
    prefill_block_tables: Tensor  # int32 [num_prefills, max_blocks]
    decode_block_tables: Tensor  # int32 [num_decodes, max_blocks]
    decode_context_lens: Tensor  # int32 [num_decodes], includes the new token

    @property
    def num_decodes(self) -> int:
        """Decode sequences (one token each) after the prefill tokens."""
        return int(self.decode_context_lens.shape[0])


def _gather_context(cache: Tensor, table: Tensor, length: int) -> Tensor:
    """The first `length` tokens of one sequence from a paged cache: `[kv_heads, length, head]`."""
    block_size = cache.shape[2]
    num_blocks = -(-length // block_size)
    blocks = cache[table[:num_blocks].long()]  # [nb, kvh, bs, D]
    return blocks.transpose(0, 1).flatten(1, 2)[:, :length]


def _causal_mask(query_len: int, context_len: int, device: torch.device) -> Tensor:
    """Query i of the chunk sits at position context_len - query_len + i and sees keys up to it."""
    q_pos = torch.arange(context_len - query_len, context_len, device=device)
    return torch.arange(context_len, device=device)[None, :] <= q_pos[:, None]


class PagedAttention(nn.Module):
    """Attention over a paged KV cache (no weights): prefill via SDPA, decode via `ops.paged_attention`."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale

    def forward(
        self, query: Tensor, key: Tensor, value: Tensor, kv_cache: tuple[Tensor, Tensor],
        meta: AttentionMetadata,
    ) -> Tensor:
        """`query [T, H, D]`, `key/value [T, KVH, D]` → `[T, H * D]`."""
        key_cache, value_cache = kv_cache
        if key_cache.numel():
            ops.reshape_and_cache(key, value, key_cache, value_cache, meta.slot_mapping)
        out = torch.empty_like(query)
        if meta.num_prefills:
            self._prefill(query, key, value, key_cache, value_cache, meta, out)
        if meta.num_decodes:
            start = meta.num_prefill_tokens
            ops.paged_attention(query[start:], key_cache, value_cache, meta.decode_block_tables,
                                meta.decode_context_lens, self.scale, out=out[start:])
        return out.flatten(1)

    def _prefill(
        self, query: Tensor, key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor,
        meta: AttentionMetadata, out: Tensor,
    ) -> None:
        starts = meta.prefill_query_start
        for i in range(meta.num_prefills):
            lo, hi = starts[i], starts[i + 1]
            context_len = meta.prefill_context_lens[i]
            q = query[lo:hi].transpose(0, 1)  # [H, q, D]
            if context_len == hi - lo:  # the chunk is the whole context: attend over fresh K/V
                k, v = key[lo:hi].transpose(0, 1), value[lo:hi].transpose(0, 1)
                mask = None
            else:
                table = meta.prefill_block_tables[i]
                k = _gather_context(key_cache, table, context_len)
                v = _gather_context(value_cache, table, context_len)
                mask = _causal_mask(hi - lo, context_len, query.device)
            attn = F.scaled_dot_product_attention(
                q[None], k[None].to(q.dtype), v[None].to(q.dtype), attn_mask=mask, is_causal=mask is None,
                scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads,
            )
            out[lo:hi] = attn[0].transpose(0, 1)
