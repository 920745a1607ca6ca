"""Screened greedy argmax (`ops.screened_argmax`): the kernel and the torch reference pick the first
maximum of the fp32 logits from a bf16 screen of them, over a grid of shapes and logit scales,
when the screen cannot tell the leaders apart, with the bf16 output truncated rather than
rounded, and -1 for rows with non-finite values."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import ops
from ops import reference
from ops.screen import screen_bounds

VOCABS = [1, 7, 8, 63, 64, 65, 1000, 4099]
ROWS = [1, 3, 17, 64]
HIDDEN = [8, 37, 576]


def _screen(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(hidden.bfloat16(), weight.bfloat16())


def _both(approx: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    norms = ops.weight_norms(weight)
    got = ops.screened_argmax(approx, hidden, weight, norms)
    expected = reference.screened_argmax(approx, hidden, weight, norms, *screen_bounds(weight.shape[1]))
    return got, expected


def _assert_exact_argmax(tokens: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor) -> None:
    """Each token is the fp32 argmax, or ties it to within fp32 rounding of a summation order."""
    exact = hidden.double() @ weight.double().T
    best = exact.max(dim=1)
    assert tokens.dtype == torch.int64 and tokens.shape == (hidden.shape[0],)
    for r, token in enumerate(tokens.tolist()):
        if token == int(best.indices[r]):
            continue
        assert 0 <= token < weight.shape[0], (r, token)
        tolerance = 4 * weight.shape[1] * 2.0**-24 * float(hidden[r].double().abs() @ weight[token].double().abs())
        assert float(best.values[r]) - float(exact[r, token]) <= tolerance, (r, token, int(best.indices[r]))


@pytest.mark.parametrize(("rows", "vocab", "k"), list(itertools.product(ROWS, VOCABS, HIDDEN)))
def test_kernel_and_reference_pick_the_fp32_argmax(rows: int, vocab: int, k: int) -> None:
    gen = torch.Generator().manual_seed(rows * 10_000 + vocab * 10 + k)
    hidden = torch.randn(rows, k, generator=gen) * 3
    weight = torch.randn(vocab, k, generator=gen) * 0.05
    got, expected = _both(_screen(hidden, weight), hidden, weight)
    _assert_exact_argmax(got, hidden, weight)
    _assert_exact_argmax(expected, hidden, weight)


@given(seed=st.integers(0, 2**31 - 1), scale=st.floats(1e-4, 1e4), spread=st.floats(1e-3, 1e3),
       close=st.integers(1, 8))
@settings(max_examples=60, deadline=None)
def test_leaders_the_screen_cannot_separate(seed: int, scale: float, spread: float, close: int) -> None:
    """A few weight rows differ from the leader by less than bf16 can resolve: the fp32 logits decide."""
    gen = torch.Generator().manual_seed(seed)
    vocab, k = 300, 64
    hidden = torch.randn(4, k, generator=gen) * scale
    weight = torch.randn(vocab, k, generator=gen) * spread
    leader = weight[7] + hidden[0] / hidden[0].norm() * spread * 4
    rows = torch.randint(0, vocab, (close,), generator=gen)
    weight[rows] = leader + torch.randn(close, k, generator=gen) * spread * 1e-4
    got, expected = _both(_screen(hidden, weight), hidden, weight)
    _assert_exact_argmax(got, hidden, weight)
    _assert_exact_argmax(expected, hidden, weight)


def test_exact_ties_take_the_first_and_truncated_screens_still_hold() -> None:
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(6, 96, generator=gen)
    weight = torch.randn(2000, 96, generator=gen) * 0.1
    weight[[40, 1500, 1999]] = hidden[0] * 0.2  # three identical leaders for row 0
    approx = _screen(hidden, weight)
    tokens, _ = _both(approx, hidden, weight)
    assert int(tokens[0]) == 40
    _assert_exact_argmax(tokens, hidden, weight)
    # bf16 output truncated instead of rounded to nearest: twice the output error, still covered
    fp32_sum = hidden.bfloat16().float() @ weight.bfloat16().float().T
    truncated = (fp32_sum.view(torch.int32) & ~0xFFFF).view(torch.float32).bfloat16()
    for tokens in _both(truncated, hidden, weight):
        _assert_exact_argmax(tokens, hidden, weight)


def test_non_finite_rows_are_left_to_the_caller() -> None:
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(4, 32, generator=gen)
    weight = torch.randn(100, 32, generator=gen)
    hidden[1, 3] = float("inf")
    hidden[2, 0] = float("nan")
    approx = _screen(hidden, weight)
    for tokens in _both(approx, hidden, weight):
        assert tokens[1] == -1 and tokens[2] == -1
        _assert_exact_argmax(tokens[[0, 3]], hidden[[0, 3]], weight)
    approx[3, 50] = float("inf")
    assert ops.screened_argmax(approx, hidden, weight, ops.weight_norms(weight))[3] == -1


def test_strided_screen_and_bad_arguments() -> None:
    gen = torch.Generator().manual_seed(9)
    hidden = torch.randn(5, 16, generator=gen)
    weight = torch.randn(70, 16, generator=gen)
    wide = _screen(hidden, torch.cat([weight, weight]))[:, :70]  # rows with a stride of 140
    _assert_exact_argmax(ops.screened_argmax(wide, hidden, weight, ops.weight_norms(weight)), hidden, weight)
    norms = ops.weight_norms(weight)
    approx = _screen(hidden, weight)
    for bad in ((approx.float(), hidden, weight, norms), (approx, hidden[:4], weight, norms),
                (approx, hidden, weight[:69], norms), (approx, hidden, weight, norms[:69]),
                (approx, hidden.double(), weight, norms), (approx[:, :0], hidden, weight[:0], norms[:0])):
        with pytest.raises(ValueError):
            ops.screened_argmax(*bad)


def test_weight_norms_round_up() -> None:
    weight = torch.randn(50, 33, generator=torch.Generator().manual_seed(1))
    norms = ops.weight_norms(weight)
    assert norms.dtype == torch.float32 and bool((norms.double() >= weight.double().norm(dim=1)).all())
