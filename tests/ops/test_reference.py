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
