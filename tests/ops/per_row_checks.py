"""What both quantized-linear test files share: `quant_linear(..., per_row=True)` gives each row the
bits it has alone, whatever the step's row count (a MoE expert's grouped rows rely on it), and the
`quant_fixed_gemm` kernel deterministic mode's exact rows may take (`ops.quant`'s fixed path)."""

from __future__ import annotations

import torch

import ops
from ops.build import cpu_ops
from ops.quant import QuantFormat, check_qweight


def per_row_bits_match_alone(x: torch.Tensor, qweight: torch.Tensor, fmt: QuantFormat, exact: int) -> torch.Tensor:
    """`quant_linear(..., per_row=True)` of every row of `x` (its first `exact` on fp32 activations),
    after checking the first, last and exact-boundary rows against each row run alone; returns the rows."""
    got = ops.quant_linear(x, qweight, fmt, exact_rows=exact, per_row=True)
    m = x.shape[0]
    for i in sorted({0, exact - 1, exact, m - 1} & set(range(m))):
        alone = ops.quant_linear(x[i:i + 1], qweight, fmt, exact_rows=int(i < exact), per_row=True)
        assert torch.equal(got[i:i + 1], alone), i
    return got


def fixed_gemm_linear(x: torch.Tensor, qweight: torch.Tensor, fmt: QuantFormat,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 `x [M, K] @ dequantize(qweight).T + bias` on `quant_fixed_gemm`, bit for bit as
    `ops.linear(..., fixed=pack_fixed(W))` on the dequantized weight (one fma chain per output
    over k in order), without an fp32 copy of it."""
    check_qweight(qweight, fmt, x.shape[-1])
    out = x.new_empty((x.shape[0], qweight.shape[0]))
    cpu_ops().quant_fixed_gemm(out, x.contiguous(), qweight, fmt.type_id, bias)
    return out
