"""`LinearRows.exact_ranges`: a packed linear keeps fp32 activations on exactly the rows in the ranges (each
row as it computes alone, exact or int8-rounded), wherever the ranges sit in the step."""

from __future__ import annotations

import pytest
import torch

from engine.model.execution_policy import LinearRows
from engine.model.quant_linear import QuantLinear
from ops import quant
from ops.reference import quant as ref


@pytest.mark.parametrize("ranges", [((0, 3), (5, 8)), ((2, 4),), ((0, 11),), ((10, 11),)])
def test_rows_in_the_ranges_are_exact_the_others_int8(ranges: tuple[tuple[int, int], ...]) -> None:
    g = torch.Generator().manual_seed(4)
    weight, x = torch.randn(24, 64, generator=g), torch.randn(11, 64, generator=g)
    layer = QuantLinear(64, [(quant.Q4_1, ref.quantize(weight, quant.Q4_1.type_id))], torch.randn(24, generator=g))
    exact = {r for start, end in ranges for r in range(start, end)}
    out = layer(x, LinearRows(exact_rows=x.shape[0], exact_ranges=ranges))
    for r in range(x.shape[0]):
        alone = layer(x[r : r + 1], LinearRows(exact_rows=1 if r in exact else 0))
        assert torch.equal(out[r : r + 1], alone), r
    plain = layer(x)  # no exact rows: every row int8-rounded
    assert not torch.equal(out[sorted(exact)], plain[sorted(exact)])
