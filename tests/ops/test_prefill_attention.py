"""paged_prefill_attention: compiled kernels against the torch reference, whole prompts, chunks after
cached context, prefix-cache hits and single tokens mixed in one call (CPU always, CUDA when present)."""

from __future__ import annotations

import itertools

import pytest
import torch

import ops
from tests.ops.paged_inputs import HEAD_PAIRS, TOLERANCE, PrefillInputs, make_paged, make_prefill

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def mixed_batch(block_size: int) -> list[tuple[int, int]]:
    """(q_len, context_len) per sequence: every case a step can hold, in one call."""
    return [
        (1, 1),                            # a one-token prompt
        (37, 37),                          # a whole prompt, no cached context
        (block_size + 1, block_size + 1),  # a whole prompt one past a block boundary
        (16, 80),                          # a later chunk of a chunked prefill (64 tokens cached)
        (5, 300),                          # a prefix-cache hit: long cached context, short new chunk
        (1, 129),                          # a single new token after its context
        (block_size, 3 * block_size),      # a chunk that fills exactly one block
    ]


def check_against_reference(args: PrefillInputs, dtype: torch.dtype) -> None:
    scale = args[0].shape[-1] ** -0.5
    actual = ops.paged_prefill_attention(*args, scale)
    expected = ops.reference.paged_prefill_attention(*args, scale)
    assert torch.isfinite(actual).all()
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("head_size", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("heads", HEAD_PAIRS, ids=str)
def test_cpu_matches_reference_fp32(heads: tuple[int, int], head_size: int, block_size: int) -> None:
    args = make_prefill(mixed_batch(block_size), heads, head_size, block_size, torch.float32, "cpu", 1)
    check_against_reference(args, torch.float32)


SAMPLED = [  # (heads, head_size, block_size, dtype)
    ((9, 3), 64, 16, torch.bfloat16),
    ((32, 8), 128, 32, torch.bfloat16),
    ((16, 1), 256, 8, torch.bfloat16),
    ((8, 8), 80, 16, torch.float16),
    ((32, 8), 96, 8, torch.float16),
    ((9, 3), 128, 32, torch.float16),
]


@pytest.mark.parametrize(("heads", "head_size", "block_size", "dtype"), SAMPLED, ids=str)
def test_cpu_matches_reference_half_precision(
    heads: tuple[int, int], head_size: int, block_size: int, dtype: torch.dtype
) -> None:
    check_against_reference(make_prefill(mixed_batch(block_size), heads, head_size, block_size, dtype, "cpu", 2),
                            dtype)


@pytest.mark.parametrize("pairs", [[(700, 700)], [(3, 2000)], [(400, 1500), (1, 1)]], ids=str)
def test_long_prompts_and_long_cached_contexts(pairs: list[tuple[int, int]]) -> None:
    """Many query tiles per sequence (uneven causal work across threads) and long prefix hits."""
    check_against_reference(make_prefill(pairs, (9, 3), 64, 16, torch.float32, "cpu", 3), torch.float32)


def test_empty_sequence_in_the_batch() -> None:
    """A sequence with no new tokens contributes no rows and disturbs nobody else."""
    check_against_reference(make_prefill([(4, 4), (0, 12), (6, 30)], (8, 8), 64, 8, torch.float32, "cpu", 4),
                            torch.float32)


def test_single_token_equals_decode_kernel() -> None:
    """With q_len 1 everywhere, prefill attention is decode attention."""
    lens = [1, 15, 16, 17, 300]
    query, key_cache, value_cache, tables, context_lens = make_paged(lens, (32, 8), 128, 16, torch.float32,
                                                                     "cpu", 5)
    starts = torch.arange(len(lens) + 1, dtype=torch.int32)
    prefill = ops.paged_prefill_attention(query, key_cache, value_cache, tables, starts, context_lens, 0.1)
    decode = ops.paged_attention(query, key_cache, value_cache, tables, context_lens, 0.1)
    torch.testing.assert_close(prefill, decode, atol=1e-5, rtol=1e-5)


def test_out_argument_is_filled_and_returned() -> None:
    args = make_prefill([(5, 5), (3, 40)], (8, 8), 64, 16, torch.float32, "cpu", 6)
    out = torch.zeros(args[0].shape)
    assert ops.paged_prefill_attention(*args, 0.125, out=out) is out
    torch.testing.assert_close(out, ops.reference.paged_prefill_attention(*args, 0.125))


def test_reference_backend_is_used_when_asked() -> None:
    args = make_prefill([(3, 3), (2, 17)], (9, 3), 64, 8, torch.float32, "cpu", 7)
    via_reference = ops.paged_prefill_attention(*args, 0.1, policy=ops.REFERENCE)
    torch.testing.assert_close(via_reference, ops.reference.paged_prefill_attention(*args, 0.1), atol=0, rtol=0)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("head_size", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_cuda_matches_reference(dtype: torch.dtype, head_size: int) -> None:
    """Every block size x head pair, the mixed batch plus a long prompt and a long prefix hit."""
    for block_size, heads in itertools.product([8, 16, 32], HEAD_PAIRS):
        pairs = [*mixed_batch(block_size), (700, 700), (3, 2000)]
        check_against_reference(make_prefill(pairs, heads, head_size, block_size, dtype, "cuda", 8), dtype)


def test_bad_block_table_entry_raises_from_the_worker_threads() -> None:
    """An error inside a parallel chunk reaches the caller (and the pool keeps working after it)."""
    args = list(make_prefill([(40, 200)] * 4, (9, 3), 64, 16, torch.float32, "cpu", 9))
    args[3] = args[3].clone()
    args[3][2, 5] = 10_000
    with pytest.raises(RuntimeError, match="block table entry 10000 out of range"):
        ops.paged_prefill_attention(*args, 0.1)
    good = make_prefill([(40, 200)] * 4, (9, 3), 64, 16, torch.float32, "cpu", 9)
    check_against_reference(good, torch.float32)
