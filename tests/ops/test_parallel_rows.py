"""ops.parallel: the row count from which kernels share OpenMP's threads, per weights, and the
kernels give the same results on either side of it (chunk pool or OpenMP, 2 threads)."""

from __future__ import annotations

import torch

import ops
from ops.linear import SMALL_GEMM_MAX_ROWS
from ops.parallel import openmp_rows, openmp_rows_for, set_openmp_rows
from ops.quant import FORMATS, QUANT_GEMV_MAX_ROWS
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
