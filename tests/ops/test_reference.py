"""The reference (the oracle for every kernel) against plain attention on contiguous K/V."""

from __future__ import annotations

import pytest
import torch

import ops


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(8, 8), (9, 3), (16, 1)])
def test_paged_attention_equals_softmax_attention(num_heads: int, num_kv_heads: int) -> None:
    torch.manual_seed(0)
    block_size, head_size, lens = 16, 64, [1, 15, 16, 17, 100]
    max_blocks = (max(lens) + block_size - 1) // block_size
    query = torch.randn(len(lens), num_heads, head_size)
    keys = torch.randn(len(lens), num_kv_heads, max_blocks * block_size, head_size)
    values = torch.randn_like(keys)
    # Sequence s owns blocks s*max_blocks ... in order: the paged layout of `keys` itself.
    def paged(x: torch.Tensor) -> torch.Tensor:
        blocks = x.view(len(lens), num_kv_heads, max_blocks, block_size, head_size).transpose(1, 2)
        return blocks.reshape(-1, num_kv_heads, block_size, head_size).contiguous()

    tables = torch.arange(len(lens) * max_blocks, dtype=torch.int32).view(len(lens), max_blocks)
    context_lens = torch.tensor(lens, dtype=torch.int32)
    out = ops.reference.paged_attention(query, paged(keys), paged(values), tables, context_lens, 0.125)
    group = num_heads // num_kv_heads
    for s, n in enumerate(lens):
        k = keys[s, :, :n].repeat_interleave(group, 0)
        v = values[s, :, :n].repeat_interleave(group, 0)
        probs = torch.softmax(query[s, :, None] @ k.transpose(1, 2) * 0.125, dim=-1)
        torch.testing.assert_close(out[s], (probs @ v)[:, 0], atol=1e-5, rtol=1e-5)


def test_empty_context_gives_zeros() -> None:
    cache = torch.randn(2, 1, 8, 64)
    out = ops.reference.paged_attention(
        torch.randn(1, 2, 64), cache, cache, torch.zeros(1, 1, dtype=torch.int32),
        torch.zeros(1, dtype=torch.int32), 1.0,
    )
    assert out.abs().sum() == 0


def test_reshape_and_cache_then_read_back() -> None:
    key, value = torch.randn(4, 2, 64), torch.randn(4, 2, 64)
    key_cache, value_cache = torch.zeros(3, 2, 8, 64), torch.zeros(3, 2, 8, 64)
    slots = torch.tensor([0, 9, -1, 23])
    ops.reference.reshape_and_cache(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache[0, :, 0], key[0]) and torch.equal(value_cache[1, :, 1], value[1])
    assert torch.equal(key_cache[2, :, 7], key[3])
    assert key_cache.count_nonzero() == 3 * 2 * 64  # the skipped token wrote nothing


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(8, 8), (9, 3)])
def test_prefill_reference_equals_sdpa(num_heads: int, num_kv_heads: int) -> None:
    """Prefill over paged K/V (shuffled blocks) equals SDPA over contiguous K/V with the causal mask
    of a chunk that starts after `cached` tokens (cached = 0: a whole prompt, plain is_causal)."""
    torch.manual_seed(1)
    block_size, head_size, context_len = 8, 64, 45
    keys = torch.randn(num_kv_heads, context_len, head_size)
    values = torch.randn_like(keys)
    num_blocks = (context_len + block_size - 1) // block_size
    order = torch.randperm(num_blocks)

    def paged(x: torch.Tensor) -> torch.Tensor:
        padded = torch.zeros(num_kv_heads, num_blocks * block_size, head_size)
        padded[:, :context_len] = x
        blocks = padded.view(num_kv_heads, num_blocks, block_size, head_size).transpose(0, 1)
        cache = torch.empty_like(blocks)
        cache[order] = blocks
        return cache.contiguous()

    table = order[None].to(torch.int32)
    for cached in (0, 20, 44):
        q_len = context_len - cached
        query = torch.randn(q_len, num_heads, head_size)
        out = ops.reference.paged_prefill_attention(
            query, paged(keys), paged(values), table, torch.tensor([0, q_len], dtype=torch.int32),
            torch.tensor([context_len], dtype=torch.int32), 0.125,
        )
        mask = torch.arange(context_len)[None, :] <= torch.arange(cached, context_len)[:, None]
        expected = torch.nn.functional.scaled_dot_product_attention(
            query.transpose(0, 1)[None], keys[None], values[None], attn_mask=mask, scale=0.125, enable_gqa=True,
        )[0].transpose(0, 1)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
