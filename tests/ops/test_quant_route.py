"""`ops.quant.route`: which path one `quant_linear` call takes, from the caller's policy, what it
asks for (bf16, per-row) and the row count."""

from __future__ import annotations

import pytest
import torch

import ops
from ops.quant import INTERLEAVED, Q4_1, Q4_1R8, QUANT_GEMV_MAX_ROWS, QuantPath, bf16_kernel, route

MANY = QUANT_GEMV_MAX_ROWS + 1


def _route(rows: int, policy: ops.OpsPolicy, fmt: ops.QuantFormat = Q4_1R8, *, int8: bool = True, exact: int = 0,
           bf16: bool = False, per_row: bool = False, x: torch.Tensor | None = None) -> QuantPath:
    return route(torch.zeros(rows, 64) if x is None else x, fmt, int8, exact, bf16, per_row, policy)


def test_the_reference_runs_in_torch_whatever_else_is_asked() -> None:
    for rows in (0, 1, MANY):
        assert _route(rows, ops.REFERENCE) is QuantPath.TORCH
        assert _route(rows, ops.REFERENCE, per_row=True) is QuantPath.TORCH
        assert _route(rows, ops.REFERENCE, bf16=True) is QuantPath.TORCH_BF16


def test_the_fastest_kernel_for_each_row_count() -> None:
    assert Q4_1R8 in INTERLEAVED.values() and Q4_1 not in INTERLEAVED.values()
    for rows in (0, 1, QUANT_GEMV_MAX_ROWS):
        assert _route(rows, ops.FASTEST) is QuantPath.KERNEL
    assert _route(MANY, ops.FASTEST) is QuantPath.SPLIT  # an eight-row layout's int8 rows stay on the kernel
    assert _route(MANY, ops.FASTEST, exact=MANY) is QuantPath.ONEDNN  # every row exact
    assert _route(MANY, ops.FASTEST, int8=False) is QuantPath.ONEDNN
    assert _route(MANY, ops.FASTEST, Q4_1) is QuantPath.ONEDNN
    assert _route(MANY, ops.FASTEST, x=torch.zeros(MANY, 3, 64), exact=MANY) is QuantPath.SPLIT  # 3-D: no exact rows


def test_fixed_order_and_per_row_keep_one_arithmetic_per_row() -> None:
    for rows in (1, MANY):
        assert _route(rows, ops.FIXED_ORDER) is QuantPath.FIXED
        assert _route(rows, ops.FIXED_ORDER, Q4_1, int8=False) is QuantPath.FIXED
        for policy in (ops.FASTEST, ops.FIXED_ORDER):
            assert _route(rows, policy, Q4_1, per_row=True) is QuantPath.KERNEL
    assert _route(0, ops.FIXED_ORDER) is QuantPath.KERNEL  # nothing to compute


@pytest.mark.parametrize("policy", [ops.FASTEST, ops.FIXED_ORDER])
def test_bf16_on_its_kernel_where_there_is_one(policy: ops.OpsPolicy) -> None:
    want = QuantPath.BF16 if bf16_kernel() is not None else QuantPath.TORCH_BF16
    assert _route(MANY, policy, bf16=True) is want
    assert _route(1, policy, bf16=True) is want


def test_the_entry_runs_the_routed_path() -> None:
    """The entry gives the bits of its path's own arithmetic: the reference's for the reference, the
    per-row kernel's (each row as alone) for per_row, past the crossover."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(16, 64, generator=gen)
    qweight, fmt = ops.quant.interleave(ops.reference.quant.quantize(w, Q4_1.type_id), Q4_1)
    x = torch.randn(MANY, 64, generator=gen)
    assert torch.equal(ops.quant_linear(x, qweight, fmt, policy=ops.REFERENCE),
                       ops.reference.quant.quant_linear(x, qweight, fmt.type_id))
    rows = ops.quant_linear(x, qweight, fmt, per_row=True)
    assert torch.equal(rows[-1:], ops.quant_linear(x[-1:], qweight, fmt))
    out = torch.empty(MANY, 16)
    assert ops.quant_linear(x, qweight, fmt, per_row=True, out=out) is out and torch.equal(out, rows)
