"""Paged attention layer: attends a step's prefill and decode tokens over the block cache.

A step's tokens are flattened with prefill (chunk) tokens first, one decode token per sequence after.
New K/V are already in the cache when the layer runs (``ops.rotary_embedding_and_cache`` wrote them).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import ops
from ops.attention import check_window
from ops.policy import FASTEST, OpsPolicy
from ops.reference import attention as reference


@dataclass(kw_only=True)
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
    # the prompt tokens' row ranges where they are not all the prefill rows (a recomputed sequence's
    # generated tokens keep their decode arithmetic: `StepInputs.exact_ranges`, `LinearRows`); None: all
    exact_ranges: tuple[tuple[int, int], ...] | None = None
    lora_slots: Tensor | None = None  # int64 [T]: each row's LoRA adapter slot (-1: none); None: no adapters

    @property
    def num_decodes(self) -> int:
        """Decode sequences (one token each) after the prefill tokens."""
        return int(self.decode_context_lens.shape[0])

    @cached_property
    def prefill_query_start_loc(self) -> Tensor:
        """``prefill_query_start`` as an int32 device tensor, made once per step for every layer."""
        return self._device_int32(self.prefill_query_start)

    @cached_property
    def prefill_context_lens_tensor(self) -> Tensor:
        """``prefill_context_lens`` as an int32 device tensor, made once per step for every layer."""
        return self._device_int32(self.prefill_context_lens)

    def _device_int32(self, values: list[int]) -> Tensor:
        return torch.tensor(values, dtype=torch.int32).to(self.slot_mapping.device, non_blocking=True)


class PagedAttention(nn.Module):
    """Attention over a paged KV cache (no weights): prefill via `ops.paged_prefill_attention`, decode via
    `ops.paged_attention`; both read K/V from the cache, so they must be written before `forward`.
    `window` > 0: a sliding window, each query sees the last `window` positions up to its own
    (transformers' sliding mask); 0: full causal attention."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, window: int = 0) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.window = check_window(window)

    def forward(
        self, query: Tensor, key: Tensor, value: Tensor, kv_cache: tuple[Tensor, Tensor],
        meta: AttentionMetadata, sinks: Tensor | None = None, policy: OpsPolicy = FASTEST,
    ) -> Tensor:
        """`query [T, H, D]`, `key/value [T, KVH, D]` (used only without a cache) → `[T, H * D]`.
        `sinks` (fp32 `[H]`, gpt-oss): each head's learned logit in the softmax denominator."""
        key_cache, value_cache = kv_cache
        out = query.new_empty(query.shape)
        num_prefill = meta.num_prefill_tokens
        if meta.num_prefills and key_cache.numel():
            ops.paged_prefill_attention(
                query[:num_prefill], key_cache, value_cache, meta.prefill_block_tables,
                meta.prefill_query_start_loc, meta.prefill_context_lens_tensor, self.scale, out=out[:num_prefill],
                window=self.window, sinks=sinks, policy=policy,
            )
        elif meta.num_prefills:
            self._prefill_without_cache(query, key, value, meta, out, sinks)
        if meta.num_decodes:
            ops.paged_attention(query[num_prefill:], key_cache, value_cache, meta.decode_block_tables,
                                meta.decode_context_lens, self.scale, out=out[num_prefill:], window=self.window,
                                sinks=sinks, policy=policy)
        return out.flatten(1)

    def _prefill_without_cache(self, query: Tensor, key: Tensor, value: Tensor, meta: AttentionMetadata,
                               out: Tensor, sinks: Tensor | None = None) -> None:
        """Whole prompts attending over their own fresh K/V: the engine's profiling pass, which runs
        with an empty cache (every slot -1), so nothing can be read back from blocks."""
        starts = meta.prefill_query_start
        for i in range(meta.num_prefills):
            lo, hi = starts[i], starts[i + 1]
            if meta.prefill_context_lens[i] != hi - lo:
                raise ValueError("a prefill over cached context needs a KV cache")
            q, k, v = (t[lo:hi].transpose(0, 1)[None] for t in (query, key, value))
            mask = None
            if self.window or sinks is not None:  # causal, within the window: key j seen from query i when
                offsets = torch.arange(hi - lo, device=query.device)  # i - window < j <= i
                distance = offsets[:, None] - offsets[None, :]
                mask = (distance >= 0) & (distance < (self.window or hi - lo))
            # no fused form with sinks: the reference's arithmetic (ops/reference/attention.py)
            if sinks is not None and mask is not None:
                group = self.num_heads // self.num_kv_heads
                scores = q[0].float() @ k[0].float().repeat_interleave(group, 0).transpose(1, 2) * self.scale
                probs = reference.softmax_with_sinks(scores.masked_fill(~mask, float("-inf")), sinks.view(-1, 1, 1))
                out[lo:hi] = (probs @ v[0].float().repeat_interleave(group, 0)).transpose(0, 1).to(out.dtype)
                continue
            attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.scale,
                                                  enable_gqa=self.num_heads != self.num_kv_heads)
            out[lo:hi] = attn[0].transpose(0, 1)
