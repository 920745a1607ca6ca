"""Sliding-window paged attention (decode and prefill): the compiled kernels against the torch
reference over a grid of shapes and windows, the reference against transformers' sliding mask
written out densely, and the contract that nothing before a window is read: those slots hold NaN
and the table entries of blocks wholly before it hold -1 (CPU always, CUDA when present)."""

from __future__ import annotations

import random

import pytest
import torch

import ops
from ops.attention_rows import rows_as_sequences
from tests.ops.paged_inputs import HEAD_PAIRS, TOLERANCE, Inputs, PrefillInputs, make_paged, make_prefill
from tests.ops.test_kv_int8 import int8_caches

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def hide_before(key_cache: torch.Tensor, value_cache: torch.Tensor, tables: torch.Tensor,
                first_seen: list[int]) -> None:
    """What a windowed kernel must never read, made unreadable in place: in sequence s the slots of
    positions < first_seen[s] hold NaN and its table entries of blocks wholly before it hold -1."""
    block_size = key_cache.shape[2]
    for seq, first in enumerate(first_seen):
        for pos in range(first):
            block = int(tables[seq, pos // block_size])
            if block >= 0:
                key_cache[block, :, pos % block_size] = float("nan")
                value_cache[block, :, pos % block_size] = float("nan")
        tables[seq, : first // block_size] = -1


def windowed_decode(lens: list[int], heads: tuple[int, int], head_size: int, block_size: int, dtype: torch.dtype,
                    window: int, seed: int, device: str = "cpu") -> Inputs:
    query, key_cache, value_cache, tables, context_lens = make_paged(lens, heads, head_size, block_size, dtype,
                                                                     "cpu", seed)
    hide_before(key_cache, value_cache, tables, [max(0, n - window) for n in lens])
    return tuple(t.to(device) for t in (query, key_cache, value_cache, tables, context_lens))  # type: ignore[return-value]


def windowed_prefill(pairs: list[tuple[int, int]], heads: tuple[int, int], head_size: int, block_size: int,
                     dtype: torch.dtype, window: int, seed: int, device: str = "cpu") -> PrefillInputs:
    query, key_cache, value_cache, tables, starts, context_lens = make_prefill(pairs, heads, head_size, block_size,
                                                                               dtype, "cpu", seed)
    hide_before(key_cache, value_cache, tables, [max(0, c - q - window + 1) for q, c in pairs])
    return tuple(t.to(device) for t in (query, key_cache, value_cache, tables, starts, context_lens))  # type: ignore[return-value]


def dense_sliding(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, q_pos: torch.Tensor, window: int,
                  scale: float) -> torch.Tensor:
    """Attention of queries `[q, H, D]` at positions `q_pos` over `keys/values [ctx, KVH, D]` under
    transformers' masking_utils: causal (kv_idx <= q_idx) and sliding_window_overlay
    (kv_idx > q_idx - sliding_window)."""
    group = query.shape[1] // keys.shape[1]
    k = keys.float().repeat_interleave(group, 1).transpose(0, 1)  # [H, ctx, D]
    v = values.float().repeat_interleave(group, 1).transpose(0, 1)
    kv_idx = torch.arange(keys.shape[0])[None, :]
    mask = (kv_idx <= q_pos[:, None]) & (kv_idx > q_pos[:, None] - window)
    scores = (query.float().transpose(0, 1) @ k.transpose(1, 2)) * scale
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1)
    return (probs @ v).transpose(0, 1)


@pytest.mark.parametrize("window", [1, 2, 7, 16, 17, 40])
def test_reference_is_transformers_sliding_mask(window: int) -> None:
    gen = torch.Generator().manual_seed(window)
    block_size, ctx, q_len, heads, dim = 8, 45, 12, (4, 2), 16
    keys, values = torch.randn(ctx, heads[1], dim, generator=gen), torch.randn(ctx, heads[1], dim, generator=gen)
    query = torch.randn(q_len, heads[0], dim, generator=gen)
    blocks = (ctx + block_size - 1) // block_size
    cache_shape = (blocks, heads[1], block_size, dim)
    key_cache, value_cache = torch.zeros(cache_shape), torch.zeros(cache_shape)
    for pos in range(ctx):
        key_cache[pos // block_size, :, pos % block_size] = keys[pos]
        value_cache[pos // block_size, :, pos % block_size] = values[pos]
    tables = torch.arange(blocks, dtype=torch.int32)[None]
    expected = dense_sliding(query, keys, values, torch.arange(ctx - q_len, ctx), window, 0.25)
    starts, lens = torch.tensor([0, q_len], dtype=torch.int32), torch.tensor([ctx], dtype=torch.int32)
    prefill = ops.reference.paged_prefill_attention(query, key_cache, value_cache, tables, starts, lens, 0.25,
                                                    window=window)
    torch.testing.assert_close(prefill, expected, atol=1e-5, rtol=1e-5)
    decode = ops.reference.paged_attention(query[-1:], key_cache, value_cache, tables, lens, 0.25, window=window)
    torch.testing.assert_close(decode, expected[-1:], atol=1e-5, rtol=1e-5)
    # a window past the context sees every key: plain causal attention
    full = ops.reference.paged_prefill_attention(query, key_cache, value_cache, tables, starts, lens, 0.25)
    if window >= ctx:
        torch.testing.assert_close(prefill, full, atol=0, rtol=0)
    else:
        assert not torch.allclose(prefill, full)


def check_decode(args: Inputs, window: int, dtype: torch.dtype, tol: float | None = None) -> None:
    scale = args[0].shape[-1] ** -0.5
    actual = ops.paged_attention(*args, scale, window=window)
    expected = ops.reference.paged_attention(*args, scale, window=window)
    assert torch.isfinite(actual).all()
    tol = TOLERANCE[dtype] if tol is None else tol
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), atol=tol, rtol=tol)


def check_prefill(args: PrefillInputs, window: int, dtype: torch.dtype, tol: float | None = None) -> None:
    scale = args[0].shape[-1] ** -0.5
    actual = ops.paged_prefill_attention(*args, scale, window=window)
    expected = ops.reference.paged_prefill_attention(*args, scale, window=window)
    assert torch.isfinite(actual).all()
    tol = TOLERANCE[dtype] if tol is None else tol
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), atol=tol, rtol=tol)


DECODE_LENS = [1, 5, 15, 16, 17, 33, 64, 100, 301]  # windows below, at and past each
WINDOWS = [1, 3, 16, 17, 50, 1000]


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("heads", HEAD_PAIRS, ids=str)
def test_cpu_decode_matches_reference(heads: tuple[int, int], block_size: int, window: int) -> None:
    lens = random.Random(window * block_size).sample(DECODE_LENS, len(DECODE_LENS))
    check_decode(windowed_decode(lens, heads, 64, block_size, torch.float32, window, block_size), window, torch.float32)


@pytest.mark.parametrize(("heads", "head_size", "block_size", "dtype", "window"), [
    ((9, 3), 64, 16, torch.bfloat16, 17),
    ((32, 8), 128, 32, torch.bfloat16, 5),
    ((8, 8), 80, 8, torch.float16, 33),
    ((16, 1), 128, 16, torch.float16, 100),
], ids=str)
def test_cpu_decode_half_precision(heads: tuple[int, int], head_size: int, block_size: int, dtype: torch.dtype,
                                   window: int) -> None:
    check_decode(windowed_decode(DECODE_LENS, heads, head_size, block_size, dtype, window, 5), window, dtype)


def test_decode_without_a_window_is_unchanged() -> None:
    args = make_paged(DECODE_LENS, (9, 3), 64, 16, torch.float32, "cpu", 6)
    plain = ops.paged_attention(*args, 0.125)
    for none in (0, -1, 10_000):
        torch.testing.assert_close(ops.paged_attention(*args, 0.125, window=none), plain, atol=0, rtol=0)
    with pytest.raises(ValueError, match="window must be an int >= -1"):
        ops.paged_attention(*args, 0.125, window=-2)


def prefill_batch(block_size: int) -> list[tuple[int, int]]:
    """(q_len, context_len): whole prompts longer than the windows, later chunks, prefix hits, single tokens."""
    return [(1, 1), (37, 37), (block_size + 1, block_size + 1), (16, 80), (5, 300), (1, 129), (70, 70),
            (block_size, 3 * block_size), (130, 200)]


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("heads", HEAD_PAIRS, ids=str)
def test_cpu_prefill_matches_reference(heads: tuple[int, int], block_size: int, window: int) -> None:
    args = windowed_prefill(prefill_batch(block_size), heads, 64, block_size, torch.float32, window, 7)
    check_prefill(args, window, torch.float32)


@pytest.mark.parametrize(("heads", "head_size", "block_size", "dtype", "window"), [
    ((9, 3), 64, 16, torch.bfloat16, 17),
    ((32, 8), 128, 32, torch.bfloat16, 5),
    ((8, 8), 80, 8, torch.float16, 33),
    ((16, 1), 256, 16, torch.float16, 100),
    ((8, 8), 96, 16, torch.float32, 64),
], ids=str)
def test_cpu_prefill_other_shapes(heads: tuple[int, int], head_size: int, block_size: int, dtype: torch.dtype,
                                  window: int) -> None:
    args = windowed_prefill(prefill_batch(block_size), heads, head_size, block_size, dtype, window, 8)
    check_prefill(args, window, dtype)


@pytest.mark.parametrize("window", [1, 17, 50])
def test_prefill_rows_equal_decode_rows(window: int) -> None:
    """Each prefill row is the decode of its position (ops/attention_rows.py), windows included,
    and the fixed-order prefill (decode's per-row bits) passes the window on."""
    args = windowed_prefill(prefill_batch(16), (9, 3), 64, 16, torch.float32, window, 9)
    query, key_cache, value_cache, tables, starts, lens = args
    row_tables, row_lens = rows_as_sequences(tables, starts, lens)
    by_rows = ops.paged_attention(query.contiguous(), key_cache, value_cache, row_tables, row_lens, 0.125,
                                  window=window)
    torch.testing.assert_close(ops.paged_prefill_attention(*args, 0.125, window=window), by_rows,
                               atol=1e-5, rtol=1e-5)
    fixed = ops.paged_prefill_attention(*args, 0.125, window=window, policy=ops.FIXED_ORDER)
    torch.testing.assert_close(fixed, by_rows, atol=0, rtol=0)


@pytest.mark.parametrize(("heads", "head_size", "block_size", "window"), [
    ((9, 3), 64, 16, 17), ((8, 8), 128, 16, 5), ((32, 8), 64, 8, 40), ((16, 1), 128, 32, 1), ((4, 2), 80, 16, 3),
], ids=str)
def test_cpu_int8_cache_with_a_window(heads: tuple[int, int], head_size: int, block_size: int, window: int) -> None:
    """int8 K/V (the AVX-512 block path at block 16, head 64/128, small groups; the generic loop
    elsewhere) against the reference over the same rows; hidden rows quantize to a NaN scale."""
    query, key_cache, value_cache, tables, lens = windowed_decode(DECODE_LENS, heads, head_size, block_size,
                                                                  torch.float32, window, 10)
    check_decode((query, *int8_caches(key_cache, value_cache), tables, lens), window, torch.float32)
    pq, pk, pv, ptables, starts, plens = windowed_prefill(prefill_batch(block_size), heads, head_size, block_size,
                                                          torch.float32, window, 11)
    check_prefill((pq, *int8_caches(pk, pv), ptables, starts, plens), window, torch.float32)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("head_size", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_cuda_matches_reference(dtype: torch.dtype, head_size: int) -> None:
    """Decode (a 1500-token context: split-K partitions wholly before the window) and prefill."""
    for block_size in (8, 16, 32):
        for window in (1, 17, 600, 5000):
            lens = [*DECODE_LENS, 1500]
            check_decode(windowed_decode(lens, (16, 4), head_size, block_size, dtype, window, 12, "cuda"), window,
                         dtype)
            args = windowed_prefill(prefill_batch(block_size), (9, 3), head_size, block_size, dtype, window, 13,
                                    "cuda")
            check_prefill(args, window, dtype)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_cuda_int8_cache_with_a_window(dtype: torch.dtype) -> None:
    query, key_cache, value_cache, tables, lens = windowed_decode([*DECODE_LENS, 1500], (16, 4), 128, 16,
                                                                  torch.float32, 33, 14)
    decode = (query.to(dtype), *int8_caches(key_cache, value_cache), tables, lens)
    check_decode(tuple(t.cuda() for t in decode), 33, dtype)  # type: ignore[arg-type]
    pq, pk, pv, ptables, starts, plens = windowed_prefill(prefill_batch(16), (9, 3), 128, 16, torch.float32, 33, 15)
    prefill = (pq.to(dtype), *int8_caches(pk, pv), ptables, starts, plens)
    check_prefill(tuple(t.cuda() for t in prefill), 33, dtype)  # type: ignore[arg-type]
