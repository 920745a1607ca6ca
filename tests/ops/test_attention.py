"""paged_attention: compiled kernels against the torch reference (CPU always, CUDA when present)."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

import ops
from tests.ops.paged_inputs import HEAD_PAIRS, TOLERANCE, Inputs, context_lengths, make_paged

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def check_against_reference(args: Inputs, dtype: torch.dtype) -> None:
    scale = args[0].shape[-1] ** -0.5
    actual = ops.paged_attention(*args, scale)
    expected = ops.reference.paged_attention(*args, scale)
    assert torch.isfinite(actual).all()
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("heads", HEAD_PAIRS, ids=str)
@pytest.mark.parametrize("num_seqs", [1, 7, 33])
def test_cpu_matches_reference_fp32(num_seqs: int, heads: tuple[int, int], head_size: int, block_size: int) -> None:
    rng = random.Random(f"{num_seqs}{heads}{head_size}{block_size}")
    lens = context_lengths(num_seqs, block_size, rng)
    check_against_reference(make_paged(lens, heads, head_size, block_size, torch.float32, "cpu", 1), torch.float32)


SAMPLED = [  # (num_seqs, heads, head_size, block_size, dtype, long context)
    (7, (32, 8), 128, 16, torch.float32, 2048),
    (1, (16, 1), 64, 32, torch.float32, 4100),
    (33, (9, 3), 64, 8, torch.float32, 2049),
    (7, (9, 3), 64, 16, torch.bfloat16, 2050),
    (7, (32, 8), 128, 32, torch.bfloat16, 0),
    (33, (8, 8), 64, 8, torch.float16, 0),
    (1, (16, 1), 128, 16, torch.float16, 2047),
]


@pytest.mark.parametrize(("num_seqs", "heads", "head_size", "block_size", "dtype", "long"), SAMPLED)
def test_cpu_matches_reference_sampled(
    num_seqs: int, heads: tuple[int, int], head_size: int, block_size: int, dtype: torch.dtype, long: int
) -> None:
    lens = context_lengths(num_seqs, block_size, random.Random(num_seqs * block_size), long)
    check_against_reference(make_paged(lens, heads, head_size, block_size, dtype, "cpu", 2), dtype)


def test_out_argument_is_filled_and_returned() -> None:
    args = make_paged([5, 40], (8, 8), 64, 16, torch.float32, "cpu", 3)
    out = torch.zeros_like(args[0])
    result = ops.paged_attention(*args, 0.125, out=out)
    assert result is out
    torch.testing.assert_close(out, ops.reference.paged_attention(*args, 0.125))


def test_reference_backend_is_used_when_asked() -> None:
    args = make_paged([3, 17], (9, 3), 64, 8, torch.float32, "cpu", 4)
    policy = ops.OpsPolicy.of("reference")
    assert policy.backend == "reference"
    via_reference = ops.paged_attention(*args, 0.1, policy=policy)
    torch.testing.assert_close(via_reference, ops.reference.paged_attention(*args, 0.1), atol=0, rtol=0)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("head_size", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_cuda_matches_reference(dtype: torch.dtype, head_size: int) -> None:
    """Every block size x head pair x batch, with an 8192-token context in the 7-sequence batch."""
    rng = random.Random(f"{dtype}{head_size}")
    for block_size, heads, (num_seqs, long) in itertools.product(
        [8, 16, 32], HEAD_PAIRS, [(1, 0), (7, 8192), (33, 0)]
    ):
        lens = context_lengths(num_seqs, block_size, rng, long)
        check_against_reference(make_paged(lens, heads, head_size, block_size, dtype, "cuda", 5), dtype)
