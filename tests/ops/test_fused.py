"""Fused decoder ops (RMSNorm with and without the residual add, SiLU-and-mul, RoPE fused with the
cache write): compiled kernels against the torch reference, CPU always, CUDA when present."""

from __future__ import annotations

import itertools

import pytest
import torch

import ops
from tests.ops.paged_inputs import HEAD_PAIRS, TOLERANCE, rope_and_cache_both

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    tol = TOLERANCE[expected.dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


def rows(num: int, hidden: int, dtype: torch.dtype, device: str, seed: int) -> torch.Tensor:
    """Rows of a wider tensor (row stride > hidden), as a slice of a fused projection would be."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(num, hidden + 3, generator=gen) * 3).to(device=device, dtype=dtype)[:, :hidden]


def check_norms(num: int, hidden: int, dtype: torch.dtype, device: str) -> None:
    x, residual = rows(num, hidden, dtype, device, 0), rows(num, hidden, dtype, device, 1)
    weight = rows(1, hidden, dtype, device, 2)[0].contiguous()
    close(ops.rms_norm(x, weight, 1e-5), ops.reference.rms_norm(x, weight, 1e-5))
    got_x, got_r = x.clone(), residual.clone()
    want_x, want_r = x.clone(), residual.clone()
    returned = ops.fused_add_rms_norm(got_x, got_r, weight, 1e-6)
    assert returned[0] is got_x and returned[1] is got_r  # in place
    ops.reference.fused_add_rms_norm(want_x, want_r, weight, 1e-6)
    assert torch.equal(got_r, want_r)  # the residual sum is one rounding, exact
    close(got_x, want_x)


def check_silu(num: int, width: int, dtype: torch.dtype, device: str) -> None:
    x = rows(num, 2 * width, dtype, device, 3) * 4  # |x| up to ~40: both tails of the sigmoid
    close(ops.silu_and_mul(x), ops.reference.silu_and_mul(x))


def check_rope(heads: tuple[int, int], head_size: int, block_size: int, dtype: torch.dtype, device: str,
               with_cache: bool = True) -> None:
    num_heads, num_kv_heads = heads
    num_tokens, table_rows, num_blocks = 11, 300, 6
    gen = torch.Generator().manual_seed(head_size + block_size)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_size, generator=gen).to(device, dtype)
    cos_sin = torch.randn(table_rows, head_size, generator=gen).to(device)
    positions = torch.randint(0, table_rows, (num_tokens,), generator=gen).to(device)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens].to(device)
    slots[::4] = -1  # padding tokens write nothing
    shape = (num_blocks, num_kv_heads, block_size, head_size) if with_cache else (0, num_kv_heads, block_size,
                                                                                   head_size)
    caches = torch.randn(2, *shape, generator=gen).to(device, dtype)
    results = rope_and_cache_both(qkv, positions, cos_sin, caches, slots, num_heads, num_kv_heads,
                                  head_size)
    (buf, key_cache, value_cache), (want_buf, want_key_cache, want_value_cache) = results
    close(buf, want_buf)
    close(key_cache, want_key_cache)
    assert torch.equal(value_cache, want_value_cache)  # values are copied, never rounded


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("num", "hidden"), [(1, 576), (5, 64), (33, 100), (3, 7), (2, 4096)])
def test_rms_norms_match_reference(num: int, hidden: int, dtype: torch.dtype) -> None:
    check_norms(num, hidden, dtype, "cpu")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("num", "width"), [(1, 1536), (7, 64), (40, 100), (3, 9)])
def test_silu_and_mul_matches_reference(num: int, width: int, dtype: torch.dtype) -> None:
    check_silu(num, width, dtype, "cpu")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("head_size", [64, 80, 96, 128, 256])
def test_rope_and_cache_write_match_reference(head_size: int, block_size: int, dtype: torch.dtype) -> None:
    check_rope((9, 3), head_size, block_size, dtype, "cpu")


@pytest.mark.parametrize("heads", HEAD_PAIRS, ids=str)
def test_rope_over_head_layouts_and_without_a_cache(heads: tuple[int, int]) -> None:
    check_rope(heads, 16, 4, torch.float32, "cpu")
    check_rope(heads, 64, 16, torch.float32, "cpu", with_cache=False)


def test_rope_rejects_positions_outside_the_table() -> None:
    q, k = torch.randn(2, 2, 8), torch.randn(2, 1, 8)
    empty = torch.empty(0, 1, 4, 8)
    with pytest.raises(RuntimeError, match="outside the cos/sin table"):
        ops.rotary_embedding_and_cache(torch.tensor([0, 10]), q, k, k.clone(), torch.randn(10, 8), empty, empty,
                                       torch.zeros(2, dtype=torch.int64))


def test_reference_backend_is_used_when_asked() -> None:
    x, weight = rows(3, 64, torch.float32, "cpu", 5), torch.ones(64)
    via_reference = (ops.rms_norm(x, weight, 1e-5, policy=ops.REFERENCE), ops.silu_and_mul(x, policy=ops.REFERENCE))
    assert torch.equal(via_reference[0], ops.reference.rms_norm(x, weight, 1e-5))
    assert torch.equal(via_reference[1], ops.reference.silu_and_mul(x))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_matches_reference(dtype: torch.dtype) -> None:
    for num, hidden in [(1, 576), (33, 100), (3, 7), (2, 8192)]:
        check_norms(num, hidden, dtype, "cuda")
        check_silu(num, hidden, dtype, "cuda")
    for heads, head_size, block_size in itertools.product(HEAD_PAIRS, [64, 80, 96, 128, 256], [8, 16, 32]):
        check_rope(heads, head_size, block_size, dtype, "cuda")
    check_rope((9, 3), 64, 16, dtype, "cuda", with_cache=False)
