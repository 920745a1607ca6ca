"""ops.linear: the fp32 small-M C++ GEMM against F.linear, and torch for everything else."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ops
from ops.linear import SMALL_GEMM_MAX_ROWS

SHAPES = [(960, 576), (576, 1536), (7, 13), (33, 100), (129, 1000)]  # (N, K): SmolLM2's, then odd edges


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("m", range(1, SMALL_GEMM_MAX_ROWS + 1))
def test_small_gemm_matches_torch(m: int, n: int, k: int, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(m * n + k)
    x, weight = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
    bias = torch.randn(n, generator=gen) if with_bias else None
    torch.testing.assert_close(ops.linear(x, weight, bias), F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)


def test_leading_dims_and_strided_input() -> None:
    weight = torch.randn(50, 64)
    x = torch.randn(2, 3, 128)[..., ::2]  # 6 rows, last dim strided
    out = ops.linear(x, weight)
    assert out.shape == (2, 3, 50)
    torch.testing.assert_close(out, F.linear(x, weight), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(
    ("x", "weight"),
    [
        (torch.randn(9, 64), torch.randn(40, 64)),  # more rows than the kernel takes: torch GEMM
        (torch.randn(2, 64, dtype=torch.bfloat16), torch.randn(40, 64, dtype=torch.bfloat16)),  # not fp32
        (torch.randn(2, 64), torch.randn(64, 40).t()),  # a transposed (non-contiguous) weight
        (torch.randn(0, 64), torch.randn(40, 64)),  # no rows
    ],
)
def test_other_cases_are_torch_exactly(x: torch.Tensor, weight: torch.Tensor) -> None:
    assert torch.equal(ops.linear(x, weight), F.linear(x, weight))


def test_reference_backend_is_torch() -> None:
    x, weight = torch.randn(3, 64), torch.randn(40, 64)
    assert torch.equal(ops.linear(x, weight, policy=ops.REFERENCE), ops.reference.linear(x, weight))


def test_mismatched_shapes_are_rejected() -> None:
    with pytest.raises(ValueError, match="does not fit weight"):
        ops.linear(torch.randn(2, 63), torch.randn(40, 64))
    with pytest.raises(ValueError, match="bias must be"):
        ops.linear(torch.randn(2, 64), torch.randn(40, 64), torch.randn(39))


@pytest.mark.parametrize("rows", [9, 32, 100])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_weight_matches_torch(rows: int, with_bias: bool) -> None:
    """Larger batches go through the oneDNN-packed copy of the weight."""
    gen = torch.Generator().manual_seed(rows)
    x, weight = torch.randn(rows, 576, generator=gen), torch.randn(960, 576, generator=gen)
    bias = torch.randn(960, generator=gen) if with_bias else None
    packed = ops.pack_weight(weight)
    torch.testing.assert_close(ops.linear(x, weight, bias, packed), F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(ops.linear(x[:3], weight, bias, packed), F.linear(x[:3], weight, bias),
                               rtol=1e-5, atol=1e-4)  # few rows still take the small-M kernel


def test_only_fp32_cpu_weights_are_packed() -> None:
    assert ops.can_pack(torch.randn(4, 8)) and not ops.can_pack(torch.randn(4, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="only 2-D fp32 CPU weights"):
        ops.pack_weight(torch.randn(4, 8, dtype=torch.bfloat16))
