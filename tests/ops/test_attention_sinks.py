"""Attention sinks (gpt-oss) in the paged kernels, decode and prefill: the compiled kernels against the
torch reference over a grid of heads, block sizes and windows, with and without sinks; the
reference against transformers' gpt-oss eager attention written out densely; the no-sink path
bit-identical to a call without the argument; int8 caches; sinks that dominate (weights far
below one) and an empty context; bad sinks refused."""

from __future__ import annotations

import random

import pytest
import torch

import ops
from tests.ops.paged_inputs import HEAD_PAIRS, TOLERANCE, make_paged, make_prefill
from tests.ops.test_kv_int8 import int8_caches
from tests.ops.test_window_attention import (
    DECODE_LENS,
    prefill_batch,
    windowed_decode,
    windowed_prefill,
)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
WINDOWS = [0, 1, 17, 1000]


def sinks_for(num_heads: int, seed: int, spread: float = 2.0, device: str = "cpu") -> torch.Tensor:
    return (torch.randn(num_heads, generator=torch.Generator().manual_seed(seed)) * spread).to(device)


def hf_eager_with_sinks(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, q_pos: torch.Tensor,
                        window: int, scale: float, sinks: torch.Tensor) -> torch.Tensor:
    """transformers' gpt-oss eager_attention_forward, densely: logits plus the additive mask, the
    sink column concatenated, max subtracted, softmax, the sink column dropped, times V."""
    group = query.shape[1] // keys.shape[1]
    k = keys.float().repeat_interleave(group, 1).transpose(0, 1)
    v = values.float().repeat_interleave(group, 1).transpose(0, 1)
    kv_idx = torch.arange(keys.shape[0])[None, :]
    visible = kv_idx <= q_pos[:, None]
    if window:
        visible &= kv_idx > q_pos[:, None] - window
    mask = torch.zeros(visible.shape).masked_fill(~visible, torch.finfo(torch.float32).min)
    logits = (query.float().transpose(0, 1) @ k.transpose(1, 2)) * scale + mask
    combined = torch.cat([logits, sinks.reshape(-1, 1, 1).expand(-1, logits.shape[1], 1)], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.softmax(combined, dim=-1)[..., :-1]
    return (probs @ v).transpose(0, 1)


@pytest.mark.parametrize("window", [0, 3, 16, 40])
def test_reference_is_transformers_gpt_oss_attention(window: int) -> None:
    gen = torch.Generator().manual_seed(window + 1)
    block_size, ctx, q_len, heads, dim = 8, 45, 12, (4, 2), 16
    keys, values = torch.randn(ctx, heads[1], dim, generator=gen), torch.randn(ctx, heads[1], dim, generator=gen)
    query = torch.randn(q_len, heads[0], dim, generator=gen)
    sinks = torch.randn(heads[0], generator=gen) * 3
    blocks = (ctx + block_size - 1) // block_size
    key_cache, value_cache = (torch.zeros(blocks, heads[1], block_size, dim) for _ in range(2))
    for pos in range(ctx):
        key_cache[pos // block_size, :, pos % block_size] = keys[pos]
        value_cache[pos // block_size, :, pos % block_size] = values[pos]
    tables = torch.arange(blocks, dtype=torch.int32)[None]
    expected = hf_eager_with_sinks(query, keys, values, torch.arange(ctx - q_len, ctx), window, 0.25, sinks)
    starts, lens = torch.tensor([0, q_len], dtype=torch.int32), torch.tensor([ctx], dtype=torch.int32)
    prefill = ops.reference.paged_prefill_attention(query, key_cache, value_cache, tables, starts, lens, 0.25,
                                                    window=window, sinks=sinks)
    torch.testing.assert_close(prefill, expected, atol=1e-5, rtol=1e-5)
    decode = ops.reference.paged_attention(query[-1:], key_cache, value_cache, tables, lens, 0.25, window=window,
                                           sinks=sinks)
    torch.testing.assert_close(decode, expected[-1:], atol=1e-5, rtol=1e-5)
    plain = ops.reference.paged_prefill_attention(query, key_cache, value_cache, tables, starts, lens, 0.25,
                                                  window=window)
    assert (prefill - plain).abs().max() > 1e-2  # the sinks matter


def _decode(args: tuple[torch.Tensor, ...], window: int, sinks: torch.Tensor | None, dtype: torch.dtype) -> None:
    scale = args[0].shape[-1] ** -0.5
    actual = ops.paged_attention(*args, scale, window=window, sinks=sinks)
    expected = ops.reference.paged_attention(*args, scale, window=window, sinks=sinks)
    assert torch.isfinite(actual).all()
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), atol=tol, rtol=tol)


def _prefill(args: tuple[torch.Tensor, ...], window: int, sinks: torch.Tensor | None, dtype: torch.dtype) -> None:
    scale = args[0].shape[-1] ** -0.5
    actual = ops.paged_prefill_attention(*args, scale, window=window, sinks=sinks)
    expected = ops.reference.paged_prefill_attention(*args, scale, window=window, sinks=sinks)
    assert torch.isfinite(actual).all()
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), atol=tol, rtol=tol)


@pytest.mark.parametrize("with_sinks", [True, False], ids=["sinks", "none"])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("heads", HEAD_PAIRS, ids=str)
def test_cpu_decode_with_sinks_matches_reference(heads: tuple[int, int], block_size: int, window: int,
                                                 with_sinks: bool) -> None:
    lens = random.Random(window * block_size + 1).sample(DECODE_LENS, len(DECODE_LENS))
    args = windowed_decode(lens, heads, 64, block_size, torch.float32, window or 10**6, block_size)
    _decode(args, window, sinks_for(heads[0], block_size) if with_sinks else None, torch.float32)


@pytest.mark.parametrize("with_sinks", [True, False], ids=["sinks", "none"])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("heads", HEAD_PAIRS, ids=str)
def test_cpu_prefill_with_sinks_matches_reference(heads: tuple[int, int], block_size: int, window: int,
                                                  with_sinks: bool) -> None:
    args = windowed_prefill(prefill_batch(block_size), heads, 64, block_size, torch.float32, window or 10**6, 7)
    _prefill(args, window, sinks_for(heads[0], block_size + 1) if with_sinks else None, torch.float32)


@pytest.mark.parametrize(("heads", "head_size", "block_size", "dtype", "window"), [
    ((9, 3), 64, 16, torch.bfloat16, 17), ((8, 8), 80, 8, torch.float16, 0), ((16, 1), 128, 16, torch.bfloat16, 5),
], ids=str)
def test_cpu_half_precision_with_sinks(heads: tuple[int, int], head_size: int, block_size: int, dtype: torch.dtype,
                                       window: int) -> None:
    sinks = sinks_for(heads[0], 3)
    _decode(windowed_decode(DECODE_LENS, heads, head_size, block_size, dtype, window or 10**6, 5), window, sinks,
            dtype)
    _prefill(windowed_prefill(prefill_batch(block_size), heads, head_size, block_size, dtype, window or 10**6, 8),
             window, sinks, dtype)


@pytest.mark.parametrize(("heads", "head_size", "block_size", "window"), [
    ((9, 3), 64, 16, 17), ((8, 8), 128, 16, 0), ((32, 8), 64, 8, 40), ((4, 2), 80, 16, 3),
], ids=str)
def test_cpu_int8_cache_with_sinks(heads: tuple[int, int], head_size: int, block_size: int, window: int) -> None:
    """int8 K/V (the AVX-512 block path at block 16, head 64/128; the generic loop elsewhere) with sinks."""
    sinks = sinks_for(heads[0], 4)
    query, key_cache, value_cache, tables, lens = windowed_decode(DECODE_LENS, heads, head_size, block_size,
                                                                  torch.float32, window or 10**6, 10)
    _decode((query, *int8_caches(key_cache, value_cache), tables, lens), window, sinks, torch.float32)
    pq, pk, pv, ptables, starts, plens = windowed_prefill(prefill_batch(block_size), heads, head_size, block_size,
                                                          torch.float32, window or 10**6, 11)
    _prefill((pq, *int8_caches(pk, pv), ptables, starts, plens), window, sinks, torch.float32)


def test_no_sinks_is_bit_identical_and_sinks_change_the_output() -> None:
    args = make_paged(DECODE_LENS, (9, 3), 64, 16, torch.float32, "cpu", 6)
    plain = ops.paged_attention(*args, 0.125)
    torch.testing.assert_close(ops.paged_attention(*args, 0.125, sinks=None), plain, atol=0, rtol=0)
    with_sinks = ops.paged_attention(*args, 0.125, sinks=sinks_for(9, 1))
    assert (with_sinks - plain).abs().max() > 1e-3
    pargs = make_prefill(prefill_batch(16), (9, 3), 64, 16, torch.float32, "cpu", 6)
    pplain = ops.paged_prefill_attention(*pargs, 0.125, window=17)
    torch.testing.assert_close(ops.paged_prefill_attention(*pargs, 0.125, window=17, sinks=None), pplain,
                               atol=0, rtol=0)
    assert (ops.paged_prefill_attention(*pargs, 0.125, window=17, sinks=sinks_for(9, 1)) - pplain).abs().max() > 1e-3


def test_dominant_and_negligible_sinks() -> None:
    """A sink far above every logit leaves weights ~0 (output ~0, no overflow); far below, plain attention."""
    args = make_paged(DECODE_LENS, (4, 2), 64, 16, torch.float32, "cpu", 2)
    plain = ops.paged_attention(*args, 0.125)
    big, small = torch.full((4,), 80.0), torch.full((4,), -80.0)
    for sinks in (big, small):
        out = ops.paged_attention(*args, 0.125, sinks=sinks)
        ref = ops.reference.paged_attention(*args, 0.125, sinks=sinks)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
    assert ops.paged_attention(*args, 0.125, sinks=big).abs().max() < 1e-20
    torch.testing.assert_close(ops.paged_attention(*args, 0.125, sinks=small), plain, atol=1e-6, rtol=1e-6)


def test_empty_context_with_sinks_is_zero() -> None:
    query, key_cache, value_cache, tables, lens = make_paged([0, 5], (4, 2), 64, 16, torch.float32, "cpu", 3)
    out = ops.paged_attention(query, key_cache, value_cache, tables, lens, 0.125, sinks=sinks_for(4, 0))
    assert torch.equal(out[0], torch.zeros_like(out[0]))


def test_fixed_order_prefill_passes_the_sinks() -> None:
    args = windowed_prefill(prefill_batch(16), (9, 3), 64, 16, torch.float32, 17, 9)
    sinks = sinks_for(9, 2)
    fixed = ops.paged_prefill_attention(*args, 0.125, window=17, sinks=sinks, policy=ops.FIXED_ORDER)
    expected = ops.reference.paged_prefill_attention(*args, 0.125, window=17, sinks=sinks)
    torch.testing.assert_close(fixed, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bad", [torch.zeros(3), torch.zeros(4, dtype=torch.float64), torch.zeros(4, 1),
                                 torch.zeros(8)[::2]], ids=["count", "dtype", "shape", "strided"])
def test_bad_sinks_are_refused(bad: torch.Tensor) -> None:
    args = make_paged([5], (4, 2), 64, 16, torch.float32, "cpu", 3)
    with pytest.raises(ValueError, match="sinks must be a contiguous fp32 tensor"):
        ops.paged_attention(*args, 0.125, sinks=bad)
    pargs = make_prefill([(3, 5)], (4, 2), 64, 16, torch.float32, "cpu", 3)
    with pytest.raises(ValueError, match="sinks must be a contiguous fp32 tensor"):
        ops.paged_prefill_attention(*pargs, 0.125, sinks=bad)


@needs_cuda
@pytest.mark.parametrize("window", [0, 17])
@pytest.mark.parametrize("heads", [(9, 3), (8, 8), (32, 8)], ids=str)
def test_cuda_with_sinks_matches_reference(heads: tuple[int, int], window: int) -> None:
    """The CUDA kernels with sinks, decode (contexts past one partition too: the reduce kernel) and prefill."""
    sinks = sinks_for(heads[0], 5, device="cuda")
    lens = [*DECODE_LENS, 700, 1500]
    _decode(windowed_decode(lens, heads, 128, 16, torch.float32, window or 10**6, 12, "cuda"), window, sinks,
            torch.float32)
    _decode(windowed_decode(lens, heads, 128, 16, torch.bfloat16, window or 10**6, 12, "cuda"), window, sinks,
            torch.bfloat16)
    _prefill(windowed_prefill(prefill_batch(16), heads, 128, 16, torch.float32, window or 10**6, 13, "cuda"),
             window, sinks, torch.float32)
