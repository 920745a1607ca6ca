"""Greedy tokens of a quantized lm_head through an int8-activation screen, decided exactly.

A quantized lm_head (SmolLM2's tied Q8_0 embedding, 49152 x 576) keeps fp32 activations: its
argmax is the greedy token, and int8 activations flip near-ties. But the fp32-activation kernel
is slower per byte. Here greedy rows run the int8 kernel over the whole vocabulary, and
only the tokens that could still be the maximum get their fp32-activation logit.

The bound is exact arithmetic, not a tolerance guess. The int8 kernel computes `w . x_hat` with
`x_hat` the activation row quantized per 32-block (`ops.reference.quant.int8_activations`),
so its error against `w . x` is `w . (x_hat - x)`, at most `|w| |x_hat - x|` (Cauchy-Schwarz);
the fp32 rounding of either kernel over K terms is below `K * 2^-24 * sum |w_i x_i|`, covered by
`ROUNDING * |w| |x|` for K up to 1600. A token whose screened logit plus its bound is below some
token's screened logit minus that one's bound cannot be the maximum; the rest are computed with
fp32 activations (the lm_head's own kernel, on their packed rows) and the first maximum wins:
the token `QuantLinear(int8_activations=False)` logits give, at up to `QUANT_GEMV_MAX_ROWS` rows.
The screen runs as one fused pass per row (`ops.quant.screened_argmax`, csrc/cpu/quant_screen.cpp);
`candidates` is the same bound in torch, for tests.

Steps of `BF16_SCREEN_MIN_ROWS` greedy rows or more, on a CPU with native bf16 dot products (AMX,
AVX512-BF16), screen with a bf16 GEMM instead (oneDNN on a packed bf16 copy of the dequantized
lm_head, 2 bytes a weight, built with the screen): the int8 kernel sweeps the whole weight once per
four rows, AMX takes many rows per sweep (benchmarks/kernels/quant_rows_bench.py).
Its bound is `ops.screen`'s (bf16 rounding of both inputs, fp32 accumulation, a bf16 output),
folded into one factor per row:
`|approx_j| <= (1 + 2u)(1 + u)^2 (1 + g) |h| |w_j|`, so the output term is a multiple of `|h| |w_j|`
too. The candidates get the same fp32-activation logit, so the token does not depend on which
screen ran.

The int8 pass reads a copy of the lm_head in the kernel's eight-row layout where its format has
one (`ops.quant.interleave`: Q8_0 for SmolLM2's tied embedding, Q6_K for llama.cpp's Q4_K_M
output weights), which the int8 kernel sweeps faster than GGUF rows; the candidates' fp32-activation
logits still read the GGUF rows (the bound holds for any kernel computing `w . x_hat` in fp32: only
the summation order differs). The copy costs the lm_head's size once more (the bf16 screen's copy,
where there is one, twice that). The int8 pass is a one-stream step's whole lm_head and, without
native bf16 (AVX2), every step's: a large share of such steps.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

import ops
from engine.model.quant_linear import QuantLinear
from ops.policy import FASTEST, OpsPolicy
from ops.quant import QUANT_GEMV_MAX_ROWS, QuantFormat, interleave, screened_argmax
from ops.reference.quant import int8_activations
from ops.screen import BF16_UNIT, bf16_packing_available, native_bf16, pack_screen_weight, screen_bounds, screen_logits

ROUNDING = 1e-4  # >= 2 * K * 2^-24 for K <= 1600: both kernels' fp32 rounding, relative to |w| |x|
NORM_SLACK = 1.01  # the row norms and |x_hat - x| are themselves fp32 results
BF16_SCREEN_MIN_ROWS = 8  # where the bf16 GEMM overtakes the int8 kernel on an AMX CPU


def bf16_row_scales(hidden: Tensor) -> Tensor:
    """fp32 `[rows]`: per row, a factor s with |bf16 screen logit_j - fp32 logit_j| <= s |w_j| for
    every token j (module docstring; `ops.screen.screen_bounds` derives the two terms)."""
    k = hidden.shape[1]
    u, terms = BF16_UNIT, k * 2.0**-24
    g = terms / (1.0 - terms)
    error_scale, output_slack = screen_bounds(k)
    factor = (error_scale + output_slack * (1 + 2 * u) * (1 + u) ** 2 * (1 + g)) * (1 + 2.0**-10)
    norms = hidden.double().norm(dim=1)
    return torch.nextafter((factor * norms + 1e-30).float(), torch.tensor(math.inf))


class QuantLogitScreen:
    """The screen of a one-shard quantized lm_head: its packed weight and fp32 row norms; its ops
    run under `policy` (the model's `ExecutionPolicy.ops`)."""

    def __init__(self, fmt: QuantFormat, qweight: Tensor, in_features: int, policy: OpsPolicy = FASTEST) -> None:
        self.fmt, self.qweight, self.in_features = fmt, qweight, in_features
        self.policy = policy
        self.norms = torch.cat([ops.dequantize(rows, fmt, in_features).norm(dim=1)
                                for rows in qweight.split(4096)]) * NORM_SLACK
        self._packed_bf16: Tensor | None = None  # the bf16 screen's weight
        # the int8 pass's weight: the eight-row layout where the format has one and no bf16 screen runs
        self.int8_fmt, self.int8_weight = fmt, qweight
        if self.bf16_screen_available():  # built now: the first big step must not pay for it
            self._bf16_weight()
        if qweight.is_cpu:
            r8, r8_fmt = interleave(qweight, fmt)
            if r8_fmt is not fmt:
                self.int8_fmt, self.int8_weight = r8_fmt, r8

    @staticmethod
    def for_lm_head(lm_head: QuantLinear, policy: OpsPolicy = FASTEST) -> QuantLogitScreen | None:
        """A screen for `lm_head` if it is one quantized shard without a bias, else None."""
        shards = lm_head.shards()
        if len(shards) != 1 or shards[0][0] is None or lm_head.bias is not None:
            return None
        fmt, qweight = shards[0]
        assert fmt is not None
        return QuantLogitScreen(fmt, qweight, lm_head.in_features, policy)

    def serves(self, lm_head: QuantLinear) -> bool:
        """Whether this screen was made from `lm_head`'s current packed weight."""
        shards = lm_head.shards()
        return len(shards) == 1 and shards[0][1].data_ptr() == self.qweight.data_ptr()

    def argmax(self, hidden: Tensor) -> Tensor:
        """int64 `[rows]`: the first maximum of each row's fp32-activation logits."""
        parts = [self._argmax(part.contiguous()) for part in hidden.split(QUANT_GEMV_MAX_ROWS)]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def candidates(self, hidden: Tensor) -> Tensor:
        """bool `[rows, vocab]`: the tokens the screen cannot rule out (every maximum among them)."""
        approx = ops.quant_linear(hidden, self.int8_weight, self.int8_fmt, None, int8_activations=True,
                                  policy=self.policy)
        error = (int8_activations(hidden) - hidden).norm(dim=1, keepdim=True) * NORM_SLACK
        slack = (error + ROUNDING * hidden.norm(dim=1, keepdim=True)) * self.norms
        floor = (approx - slack).max(dim=1, keepdim=True).values  # NaN if the row has one
        unscreened = ~torch.isfinite(floor)  # a non-finite value: every token
        return (approx + slack >= floor) | unscreened

    def _argmax(self, hidden: Tensor) -> Tensor:
        tokens, _ = self.screen(hidden)
        unscreened = (tokens < 0).nonzero().squeeze(1)
        if unscreened.numel():  # a non-finite value: every token's fp32-activation logit
            rows = hidden.index_select(0, unscreened)
            exact = ops.quant_linear(rows, self.qweight, self.fmt, None, int8_activations=False, policy=self.policy)
            tokens[unscreened] = exact.max(dim=-1).indices
        return tokens

    def screen(self, hidden: Tensor) -> tuple[Tensor, Tensor]:
        """`(tokens, candidates)` int64 `[rows]` for at most `QUANT_GEMV_MAX_ROWS` rows: each row's
        token (-1 for a row with a non-finite value) and how many tokens the screen left in (one
        fused pass per row: `ops.quant.screened_argmax`)."""
        if hidden.shape[0] >= BF16_SCREEN_MIN_ROWS and self.bf16_screen_available():
            approx = screen_logits(hidden, self._bf16_weight())  # bf16: widened per row in the kernel
            return screened_argmax(approx, hidden, self.qweight, self.fmt, self.norms, ROUNDING, NORM_SLACK,
                                   row_scales=bf16_row_scales(hidden), policy=self.policy)
        approx = ops.quant_linear(hidden, self.int8_weight, self.int8_fmt, None, int8_activations=True,
                                  policy=self.policy)
        return screened_argmax(approx, hidden, self.qweight, self.fmt, self.norms, ROUNDING, NORM_SLACK,
                               policy=self.policy)

    def bf16_screen_available(self) -> bool:
        """Whether many-row steps screen with a bf16 GEMM: native bf16 dot products that oneDNN runs."""
        return self.qweight.is_cpu and native_bf16() and bf16_packing_available()

    def _bf16_weight(self) -> Tensor:
        if self._packed_bf16 is None:
            self._packed_bf16 = pack_screen_weight(ops.dequantize(self.qweight, self.fmt, self.in_features))
        return self._packed_bf16
