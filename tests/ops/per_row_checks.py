"""A check both quantized-linear test files share: `quant_linear_per_row` gives each row the bits it
has alone, whatever the step's row count (a MoE expert's grouped rows rely on it)."""

from __future__ import annotations

import torch

import ops
from ops.quant import QuantFormat


def per_row_bits_match_alone(x: torch.Tensor, qweight: torch.Tensor, fmt: QuantFormat, exact: int) -> torch.Tensor:
    """`quant_linear_per_row` of every row of `x` (its first `exact` on fp32 activations), after
    checking the first, last and exact-boundary rows against each row run alone; returns the rows."""
    got = ops.quant.quant_linear_per_row(x, qweight, fmt, True, exact)
    m = x.shape[0]
    for i in sorted({0, exact - 1, exact, m - 1} & set(range(m))):
        alone = ops.quant.quant_linear_per_row(x[i:i + 1], qweight, fmt, True, int(i < exact))
        assert torch.equal(got[i:i + 1], alone), i
    return got
