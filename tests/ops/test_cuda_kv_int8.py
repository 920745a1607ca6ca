"""The int8 KV cache on CUDA (issue 22), against the torch reference of ops/reference/kv_quant.py:
the cache writes (reshape_and_cache and the fused RoPE write) bit for bit, and the CPU kernel's
bytes too; decode and prefill attention over int8 caches within the dtype's tolerance. Runs when a
GPU is lent (gpu-marked, skipped otherwise)."""

from __future__ import annotations

import pytest
import torch

import ops
from ops.reference.kv_quant import dequantize_rows
from tests.ops.paged_inputs import HEAD_PAIRS, TOLERANCE, make_prefill, rope_and_cache_both
from tests.ops.test_kv_int8 import decode_inputs, int8_caches
from tests.ops.test_prefill_attention import mixed_batch

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
pytestmark = [pytest.mark.gpu, needs_cuda]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
HEADS = [64, 80, 96, 128, 256]


def close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert torch.isfinite(actual).all()
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head", HEADS)
def test_reshape_and_cache_quantizes_bit_for_bit(dtype: torch.dtype, head: int) -> None:
    """Every block size; the same bytes as the reference on the GPU and as the CPU kernel."""
    for block_size in (8, 16, 32):
        torch.manual_seed(block_size + head)
        num_blocks, kv_heads, tokens = 12, 3, 40
        shape = (num_blocks, kv_heads, block_size, head + 2)
        caches = [torch.randint(-128, 128, shape, dtype=torch.int8) for _ in range(2)]
        qkv = (torch.randn(tokens, 3 * kv_heads, head) * torch.logspace(-2, 2, tokens)[:, None, None]).to(dtype)
        qkv[3] = 0  # a zero row: scale 0, values 0
        slots = torch.randperm(num_blocks * block_size)[:tokens]
        slots[::7] = -1
        cpu = [c.clone() for c in caches]
        ops.reshape_and_cache(qkv[:, kv_heads: 2 * kv_heads], qkv[:, 2 * kv_heads:], cpu[0], cpu[1], slots)
        gpu_qkv, gpu_slots = qkv.cuda(), slots.cuda()
        key, value = gpu_qkv[:, kv_heads: 2 * kv_heads], gpu_qkv[:, 2 * kv_heads:]  # strided, as the model has them
        gpu = [c.cuda() for c in caches]
        want = [c.cuda() for c in caches]
        ops.reference.reshape_and_cache(key, value, want[0], want[1], gpu_slots)
        ops.reshape_and_cache(key, value, gpu[0], gpu[1], gpu_slots)
        ops.raise_device_errors(sync=True)
        for got, ref, host in zip(gpu, want, cpu, strict=True):
            assert torch.equal(got, ref) and torch.equal(got.cpu(), host)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", HEAD_PAIRS, ids=str)
def test_rope_cache_write_quantizes_like_the_reference(dtype: torch.dtype, heads: tuple[int, int]) -> None:
    num_heads, num_kv_heads = heads
    for head_size in HEADS:
        num_tokens, table_rows, num_blocks, block_size = 11, 300, 6, 16
        gen = torch.Generator().manual_seed(head_size + num_heads)
        qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_size, generator=gen).to("cuda", dtype)
        cos_sin = torch.randn(table_rows, head_size, generator=gen).cuda()
        positions = torch.randint(0, table_rows, (num_tokens,), generator=gen).cuda()
        slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens].cuda()
        slots[::4] = -1
        caches = torch.zeros(2, num_blocks, num_kv_heads, block_size, head_size + 2, dtype=torch.int8, device="cuda")
        results = rope_and_cache_both(qkv, positions, cos_sin, caches, slots, num_heads, num_kv_heads,
                                      head_size)
        ops.raise_device_errors(sync=True)
        (buf, key_cache, value_cache), (want_buf, want_key, want_value) = results
        close(buf, want_buf, dtype)
        assert torch.equal(value_cache, want_value)
        if dtype != torch.float32:  # rotated keys are rounded to the dtype first: the same bits, the same rows
            assert torch.equal(key_cache, want_key)
        else:  # fp32 rotation may differ from torch's in a last bit (FMA): a value by one step at most
            assert int((key_cache[..., :-2].int() - want_key[..., :-2].int()).abs().max()) <= 1
            torch.testing.assert_close(dequantize_rows(key_cache), dequantize_rows(want_key), atol=0.03, rtol=1e-2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_size", HEADS)
def test_decode_over_int8_matches_reference(dtype: torch.dtype, head_size: int) -> None:
    """Every head pair and block size; one long context so the split-K reduce runs too."""
    for heads in HEAD_PAIRS:
        for block_size in (8, 16, 32):
            args = [t.cuda() for t in decode_inputs(9, heads, head_size, block_size, dtype, block_size + head_size)]
            scale = head_size**-0.5
            close(ops.paged_attention(*args, scale), ops.reference.paged_attention(*args, scale), dtype)
    long = [t.cuda() for t in decode_inputs(3, (9, 3), head_size, 16, dtype, 5)]
    query, key_q, value_q, _, _ = long
    lens = torch.tensor([1500, 7, 513], dtype=torch.int32, device="cuda")
    blocks = key_q.shape[0]
    tables = torch.randint(0, blocks, (3, 1500 // 16 + 1), dtype=torch.int32, device="cuda")
    key_q = key_q.clone()
    key_q[..., -2:] = torch.tensor([0.01], dtype=torch.float16).view(torch.int8).cuda()  # finite scales everywhere
    value_q = key_q.clone()
    args = (query, key_q, value_q, tables, lens)
    close(ops.paged_attention(*args, 0.125), ops.reference.paged_attention(*args, 0.125), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_size", HEADS)
def test_prefill_over_int8_matches_reference(dtype: torch.dtype, head_size: int) -> None:
    for heads in HEAD_PAIRS:
        for block_size in (8, 16, 32):
            query, key_cache, value_cache, tables, starts, lens = make_prefill(
                [*mixed_batch(block_size), (300, 300)], heads, head_size, block_size, torch.float32, "cpu",
                head_size + block_size)
            key_q, value_q = int8_caches(key_cache, value_cache)
            args = [t.cuda() for t in (query.to(dtype), key_q, value_q, tables, starts, lens)]
            scale = head_size**-0.5
            close(ops.paged_prefill_attention(*args, scale), ops.reference.paged_prefill_attention(*args, scale),
                  dtype)
    ops.raise_device_errors(sync=True)
