"""The int8-activation screen of a quantized lm_head (`QuantLogitScreen`) picks exactly the token
the fp32-activation logits give: random and tied weights, outlier activations, non-finite rows,
more rows than one kernel call takes; and it rules out nearly the whole vocabulary."""

from __future__ import annotations

import pytest
import torch

import ops
from engine.model.quant_linear import QuantLinear
from engine.model.quant_screen import BF16_SCREEN_MIN_ROWS, NORM_SLACK, ROUNDING, QuantLogitScreen, bf16_row_scales
from ops.quant import FORMATS, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, QUANT_GEMV_MAX_ROWS, QuantFormat
from ops.reference import quant as ref
from ops.screen import bf16_packing_available, native_bf16, screen_logits

# Every packed format (GGUF order) an lm_head can be stored in.
SCREENED = [Q8_0, Q4_1, Q4_0, Q5_0, Q5_1, FORMATS["IQ4_NL"], FORMATS["MXFP4"], FORMATS["Q2_K"], FORMATS["Q3_K"],
            Q4_K, Q5_K, Q6_K, FORMATS["IQ4_XS"]]


def _lm_head(fmt: QuantFormat, vocab: int, hidden: int, seed: int) -> QuantLinear:
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab, hidden, generator=gen) * 0.05
    weight[7] = weight[3]  # an exact tie between two tokens: the first must win
    weight[vocab - 1] = weight[3]
    return QuantLinear(hidden, [(fmt, ref.quantize(weight, fmt.type_id))], int8_activations=False)


def _assert_same_argmax_up_to_rounding(tokens: torch.Tensor, want: torch.Tensor, x: torch.Tensor,
                                       weight: torch.Tensor) -> None:
    """The kernel's tokens are the reference's, except where two logits lie within fp32 summation
    rounding of each other (the kernel and torch's GEMM add in different orders): there both picks
    are maxima within that rounding, in float64."""
    exact = x.double() @ weight.double().T
    tol = 1e-4 * (x.abs().double() @ weight.abs().double().T).max(dim=1).values  # > K x 2^-24 of |x| |w|
    top = exact.max(dim=1).values
    for row in (tokens != want).nonzero().flatten().tolist():
        for token in (tokens[row], want[row]):
            assert exact[row, token] >= top[row] - tol[row], (row, int(token))
    assert (tokens != want).sum() <= 1, "more than the one built tie differs"


def _exact_tokens(lm_head: QuantLinear, hidden: torch.Tensor) -> torch.Tensor:
    return torch.cat([lm_head(part).max(dim=-1).indices for part in hidden.split(QUANT_GEMV_MAX_ROWS)])


@pytest.mark.parametrize("fmt", SCREENED, ids=lambda f: f.name)
@pytest.mark.parametrize(("vocab", "hidden", "rows"),
                         [(4099, 576, 1), (1000, 64, 40), (2048, 96, 64), (4099, 256, 1), (1000, 512, 40)])
def test_screen_picks_the_fp32_activation_argmax(fmt: QuantFormat, vocab: int, hidden: int, rows: int) -> None:
    if hidden % fmt.block_size:
        pytest.skip(f"{fmt.name} rows are blocks of {fmt.block_size}")
    lm_head = _lm_head(fmt, vocab, hidden, seed=vocab + rows)
    screen = QuantLogitScreen.for_lm_head(lm_head)
    assert screen is not None and screen.serves(lm_head)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, hidden, generator=gen)
    x[0, 5] = 40.0  # an outlier: a coarse int8 scale for its block
    weight = lm_head.dequantized_weight()
    tied = torch.randn(rows, hidden, generator=gen) * 0.01 + weight[3] * 50  # token 3 (= 7, last) on top
    for batch in (x, tied):
        assert torch.equal(screen.argmax(batch), _exact_tokens(lm_head, batch))
    assert screen.argmax(tied)[0].item() == 3
    assert screen.candidates(x).sum(dim=1).float().mean() < 0.05 * vocab  # it does screen


def test_screen_over_many_rows_and_non_finite_rows() -> None:
    lm_head = _lm_head(Q8_0, 512, 64, seed=1)
    screen = QuantLogitScreen.for_lm_head(lm_head)
    assert screen is not None
    x = torch.randn(QUANT_GEMV_MAX_ROWS + 9, 64, generator=torch.Generator().manual_seed(2))
    x[4, 0] = float("nan")
    x[QUANT_GEMV_MAX_ROWS + 2, 9] = float("inf")
    mask = screen.candidates(x[:QUANT_GEMV_MAX_ROWS])
    assert mask[4].all() and mask.sum() < mask.numel() // 4  # the NaN row is not screened, the rest are
    assert torch.equal(screen.argmax(x), _exact_tokens(lm_head, x))


@pytest.mark.parametrize("fmt", sorted(ops.quant.INTERLEAVED, key=lambda f: f.name), ids=lambda f: f.name)
def test_the_int8_pass_reads_the_eight_row_layout(fmt: QuantFormat, monkeypatch: pytest.MonkeyPatch) -> None:
    """The int8 pass reads an eight-row copy of the lm_head (a format with such a layout, a
    vocabulary of 8 n): the tokens are still the fp32-activation argmax, at one row and at many
    (without a bf16 screen, as on AVX2, every step takes the int8 pass), and the candidates are
    still few."""
    monkeypatch.setattr(QuantLogitScreen, "bf16_screen_available", lambda self: False)
    vocab, hidden = 4096, 512  # K = 256 n: the K-quants' layouts too
    lm_head = _lm_head(fmt, vocab, hidden, seed=21)
    screen = QuantLogitScreen.for_lm_head(lm_head)
    assert screen is not None and screen.int8_fmt is ops.quant.INTERLEAVED[fmt] and screen.fmt is fmt
    assert screen.qweight.data_ptr() != screen.int8_weight.data_ptr()  # the GGUF rows stay for the candidates
    gen = torch.Generator().manual_seed(22)
    x = torch.randn(QUANT_GEMV_MAX_ROWS + 12, hidden, generator=gen)
    x[0, 5] = 40.0
    weight = lm_head.dequantized_weight()
    tied = torch.randn(40, hidden, generator=gen) * 0.01 + weight[3] * 50
    for batch in (x[:1], x[:40], x, tied):
        assert torch.equal(screen.argmax(batch), _exact_tokens(lm_head, batch))
    assert screen.argmax(tied)[0].item() == 3
    assert screen.candidates(x[:64]).sum(dim=1).float().mean() < 0.05 * vocab


def test_no_screen_for_shards_or_bias() -> None:
    w = torch.randn(64, 32)
    two = QuantLinear(32, [(Q8_0, ref.quantize(w[:32], Q8_0.type_id)), (Q4_1, ref.quantize(w[32:], Q4_1.type_id))])
    biased = QuantLinear(32, [(Q8_0, ref.quantize(w, Q8_0.type_id))], bias=torch.zeros(64))
    plain = QuantLinear(32, [(None, w)])
    assert all(QuantLogitScreen.for_lm_head(m) is None for m in (two, biased, plain))


@pytest.mark.parametrize("fmt", SCREENED, ids=lambda f: f.name)
def test_fused_screen_matches_its_torch_reference(fmt: QuantFormat) -> None:
    """The fused C++ pass (`ops.quant.screened_argmax`) against `ops.reference.quant.screened_argmax`:
    the same tokens, about the same number of candidates (the bound is the same; fp32 rounding of
    `approx +- slack` may move a token on the edge), -1 for non-finite rows."""
    lm_head = _lm_head(fmt, 3001, 256, seed=5)
    screen = QuantLogitScreen.for_lm_head(lm_head)
    assert screen is not None
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(11, 256, generator=gen)
    x[2, 3] = 25.0
    x[4] = lm_head.dequantized_weight()[7] * 80  # tokens 3, 7 and the last tie: the first wins
    x[9, 1] = float("nan")
    screen.bf16_screen_available = lambda: False  # type: ignore[method-assign]  # the int8 screen at 11 rows too
    tokens, counts = screen.screen(x)
    approx = ops.quant_linear(x, screen.int8_weight, screen.int8_fmt, None, int8_activations=True)
    want, want_counts = ref.screened_argmax(approx, x, screen.qweight, fmt.type_id, screen.norms, ROUNDING,
                                            NORM_SLACK)
    assert tokens[9] == -1 and want[9] == -1
    assert torch.equal(tokens, want)
    assert tokens[4] == 3
    assert (counts - want_counts).abs().max() <= 1
    assert counts[torch.arange(11) != 9].min() >= 1 and counts.max() < 0.05 * 3001


@pytest.mark.skipif(not (native_bf16() and bf16_packing_available()), reason="no native bf16 GEMM on this CPU")
@pytest.mark.parametrize("fmt", [Q8_0, Q4_1], ids=lambda f: f.name)
def test_bf16_screen_of_many_rows_picks_the_fp32_activation_argmax(fmt: QuantFormat) -> None:
    """Steps of BF16_SCREEN_MIN_ROWS rows or more screen with a bf16 GEMM: the same tokens as the
    fp32-activation logits and as the int8 screen of each row alone, also where two tokens' logits
    are closer than bf16 rounding (they both stay candidates), with few candidates per row."""
    vocab, hidden = 4099, 576
    lm_head = _lm_head(fmt, vocab, hidden, seed=11)
    screen = QuantLogitScreen.for_lm_head(lm_head)
    assert screen is not None and screen.bf16_screen_available()
    gen = torch.Generator().manual_seed(12)
    weight = lm_head.dequantized_weight()
    x = torch.randn(BF16_SCREEN_MIN_ROWS + 5, hidden, generator=gen)
    x[1, 5] = 40.0
    d, v = weight[10] - weight[11], (weight[10] + weight[11]) * 40
    x[2] = v - (v @ d) / (d @ d) * d  # tokens 10 and 11 tie up to rounding: both stay candidates
    x[3] = weight[3] * 50  # tokens 3, 7 and the last tie exactly: the first wins
    tokens, counts = screen.screen(x)
    assert torch.equal(tokens, _exact_tokens(lm_head, x))
    assert torch.equal(tokens, torch.cat([screen.screen(row[None])[0] for row in x]))  # one row: the int8 screen
    assert tokens[3].item() == 3 and counts[2].item() >= 2
    assert counts.float().mean() < 0.05 * vocab  # it does screen
    scales = bf16_row_scales(x)
    approx = screen_logits(x, screen._bf16_weight()).float()
    dense = x @ weight.T
    assert ((approx - dense).abs() <= scales[:, None] * screen.norms).all()  # the bound holds
    kernel = ops.quant.screened_argmax(approx, x, screen.qweight, fmt, screen.norms, ROUNDING, NORM_SLACK,
                                       row_scales=scales)[0]
    want = ref.screened_argmax(approx, x, screen.qweight, fmt.type_id, screen.norms, ROUNDING, NORM_SLACK,
                               row_scales=scales)[0]
    _assert_same_argmax_up_to_rounding(kernel, want, x, weight)
    # the GEMM's bf16 output as it comes (widened per row in the kernel): the fp32 copy's tokens and counts
    raw = screen_logits(x, screen._bf16_weight())
    assert raw.dtype == torch.bfloat16
    from_bf16 = ops.quant.screened_argmax(raw, x, screen.qweight, fmt, screen.norms, ROUNDING, NORM_SLACK,
                                          row_scales=scales)
    from_fp32 = ops.quant.screened_argmax(approx, x, screen.qweight, fmt, screen.norms, ROUNDING, NORM_SLACK,
                                          row_scales=scales)
    assert all(torch.equal(a, b) for a, b in zip(from_bf16, from_fp32, strict=True))
