"""ops.parallel: the row count from which kernels share OpenMP's threads, per weights, and the
kernels give the same results on either side of it (chunk pool or OpenMP, 2 threads)."""

from __future__ import annotations

import pytest
import torch

import ops
from ops.linear import SMALL_GEMM_MAX_ROWS
from ops.parallel import openmp_rows, openmp_rows_for, set_openmp_rows
from ops.quant import FORMATS, QUANT_GEMV_MAX_ROWS, interleave
from ops.reference import quant as ref


def test_threshold_per_weights_and_round_trip() -> None:
    assert openmp_rows_for(False) == SMALL_GEMM_MAX_ROWS + 1
    assert openmp_rows_for(True) == QUANT_GEMV_MAX_ROWS + 1
    before = openmp_rows()
    try:
        set_openmp_rows(77)
        assert openmp_rows() == 77
    finally:
        set_openmp_rows(before)


def test_quant_linear_same_on_pool_and_openmp() -> None:
    fmt = FORMATS["Q4_1"]
    generator = torch.Generator().manual_seed(0)
    qweight = ref.quantize(torch.randn(1536, 576, generator=generator) * 0.05, fmt.type_id)
    x = torch.randn(5, 576, generator=generator)  # a speculative row of 1 + 4 tokens
    before, threads = openmp_rows(), torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        outs = []
        for rows in (4, 129):  # 5 rows on OpenMP's threads, then on the chunk pool
            set_openmp_rows(rows)
            outs.append(ops.quant_linear(x, qweight, fmt))
    finally:
        set_openmp_rows(before)
        torch.set_num_threads(threads)
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)


@pytest.mark.parametrize("name", ["Q4_0", "Q5_0", "Q8_0", "Q4_K", "Q6_K"])
def test_one_row_streams_cover_every_group_once(name: str) -> None:
    """A one-row pass over an eight-row layout splits its groups into chunks that shrink toward the end
    (parallel_streams): at 1, 2 and 3 threads, and for weights of one chunk or many, the row's output is
    the same bits, equal to the same row in a two-row pass (equal chunks) and close to the reference."""
    generator = torch.Generator().manual_seed(1)
    base = FORMATS[name]
    k = 512
    threads = torch.get_num_threads()
    try:
        for n in (8, 64, 8 * 300):  # one group, one chunk, about a dozen shrinking chunks
            qweight = ref.quantize(torch.randn(n, k, generator=generator) * 0.05, base.type_id)
            packed, fmt = interleave(qweight, base)
            assert fmt is not base
            x = torch.randn(2, k, generator=generator)
            outs = []
            for t in (1, 2, 3):
                torch.set_num_threads(t)
                alone = ops.quant_linear(x[:1], packed, fmt, per_row=True)
                pair = ops.quant_linear(x, packed, fmt, per_row=True)
                torch.testing.assert_close(alone, pair[:1], rtol=0, atol=0)
                outs.append(alone)
            for out in outs[1:]:
                torch.testing.assert_close(out, outs[0], rtol=0, atol=0)
            expected = ref.int8_activations(x[:1]) @ ref.dequantize(qweight, base.type_id).T
            torch.testing.assert_close(outs[0], expected, rtol=1e-4, atol=1e-4)
    finally:
        torch.set_num_threads(threads)
