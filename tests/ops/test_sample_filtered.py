"""Filtered sampling kernel (`ops.sample_filtered`: top-k, top-p, min-p, then inverse CDF) against
the torch reference over a grid of shapes and filter mixes (the same token except where the
uniform or a cut is within rounding of a boundary), the filters' semantics on hand-made
distributions (ties at a cut kept, exact quantiles), masked tokens, batch independence, and the
unfiltered case equal to `ops.sample_from_logits`."""

from __future__ import annotations

import itertools

import pytest
import torch

import ops
from ops import reference

VOCABS = [7, 257, 1000, 49152]
ROWS = [1, 17, 64]
NEAR = 1e-5


def _filters(rows: int, vocab: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A mix per row: no filter, top-k only, top-p only, min-p only, all three."""
    kind = torch.arange(rows) % 5
    top_k = torch.where((kind == 1) | (kind == 4), torch.randint(1, max(2, vocab // 3), (rows,), generator=gen), 0)
    top_p = torch.where((kind == 2) | (kind == 4), torch.rand(rows, generator=gen) * 0.98 + 0.01, 1.0)
    min_p = torch.where((kind == 3) | (kind == 4), torch.rand(rows, generator=gen) * 0.3, 0.0)
    return top_k.long(), top_p.float(), min_p.float()


def _ambiguous(logits: torch.Tensor, inv_t: float, k: int, p: float, mp: float, u: float) -> bool:
    """Within rounding of a boundary: the uniform at a CDF edge, or a top-p / min-p cut near a value."""
    w = torch.softmax(logits.double() * inv_t, dim=-1)
    if 0 < k < len(w):
        w = torch.where(logits >= torch.topk(logits, k).values[-1], w, 0.0)
        w = w / w.sum()
    if p < 1.0:
        ordered = torch.sort(w, descending=True).values
        mass = ordered.cumsum(0)
        if bool(((mass - p).abs() < NEAR).any()):
            return True
        cut = ordered[min(int((mass < p).sum()), len(w) - 1)]
        w = torch.where(w >= cut, w, 0.0)
    if mp > 0.0:
        if bool(((w - mp * w.max()).abs() < NEAR * w.max()).any()):
            return True
        w = torch.where(w >= mp * w.max(), w, 0.0)
    cdf = (w / w.sum()).cumsum(0)
    return bool(((cdf - u).abs() < NEAR).any())


@pytest.mark.parametrize(("rows", "vocab"), list(itertools.product(ROWS, VOCABS)))
def test_kernel_matches_reference(rows: int, vocab: int) -> None:
    gen = torch.Generator().manual_seed(rows * 100_000 + vocab)
    logits = torch.randn(rows, vocab, generator=gen) * 3
    inv_t = 1.0 / (torch.rand(rows, generator=gen) * 1.5 + 0.3)
    uniforms = torch.rand(rows, generator=gen)
    top_k, top_p, min_p = _filters(rows, vocab, gen)
    got = ops.sample_filtered(logits, inv_t, top_k, top_p, min_p, uniforms)
    expected = reference.sample_filtered(logits, inv_t, top_k, top_p, min_p, uniforms)
    assert got.dtype == torch.int64 and got.shape == (rows,)
    for r in (got != expected).nonzero().flatten().tolist():
        assert _ambiguous(logits[r], float(inv_t[r]), int(top_k[r]), float(top_p[r]), float(min_p[r]),
                          float(uniforms[r])), (r, int(got[r]), int(expected[r]))


def _draws(logits: list[float], uniforms: torch.Tensor, k: int = 0, p: float = 1.0, mp: float = 0.0,
           ) -> list[torch.Tensor]:
    n = len(uniforms)
    many = torch.tensor(logits).expand(n, -1).contiguous()
    args = (many, torch.ones(n), torch.full((n,), k, dtype=torch.long), torch.full((n,), p), torch.full((n,), mp),
            uniforms)
    return [ops.sample_filtered(*args), reference.sample_filtered(*args)]


GRID = (torch.arange(1000, dtype=torch.float32) + 0.5) / 1000


def test_top_p_keeps_the_smallest_set_reaching_p_ties_included() -> None:
    probs = torch.tensor([0.1, 0.5, 0.1, 0.3])
    for got in _draws(torch.log(probs).tolist(), GRID, p=0.75):  # 0.5, then 0.3 reaches 0.75
        counts = torch.bincount(got, minlength=4).float()
        assert counts[0] == 0 and counts[2] == 0
        assert abs(float(counts[1]) - 625) <= 1 and abs(float(counts[3]) - 375) <= 1
    tied = torch.log(torch.tensor([0.2, 0.4, 0.2, 0.2])).tolist()
    for got in _draws(tied, GRID, p=0.5):  # the cut value 0.2 is kept wherever it appears
        assert set(got.tolist()) == {0, 1, 2, 3}
    for got in _draws(tied, GRID, p=1e-6):
        assert set(got.tolist()) == {1}


def test_top_k_keeps_ties_and_min_p_keeps_a_share_of_the_largest() -> None:
    logits = [1.0, 3.0, 2.0, 3.0, 0.5]
    for got in _draws(logits, GRID, k=1):
        assert set(got.tolist()) == {1, 3}
    for got in _draws(logits, GRID, k=3):
        assert set(got.tolist()) == {1, 2, 3}
    probs = torch.tensor([0.05, 0.5, 0.2, 0.25])
    for got in _draws(torch.log(probs).tolist(), GRID, mp=0.35):  # keeps >= 0.175
        counts = torch.bincount(got, minlength=4).float()
        assert counts[0] == 0 and abs(float(counts[1]) - 1000 * 0.5 / 0.95) <= 1
    for got in _draws(logits, GRID, mp=1.0):
        assert set(got.tolist()) == {1, 3}


def test_masked_tokens_are_never_drawn_and_no_filter_is_plain_sampling() -> None:
    logits = torch.full((300,), float("-inf"))
    logits[[4, 90, 299]] = torch.tensor([0.0, 2.0, -5.0])
    for k, p, mp in ((0, 1.0, 0.0), (2, 1.0, 0.0), (500, 0.9, 0.0), (0, 1.0, 0.001), (3, 0.999, 0.01)):
        for got in _draws(logits.tolist(), GRID, k=k, p=p, mp=mp):
            assert set(got.tolist()) <= {4, 90, 299}
    gen = torch.Generator().manual_seed(4)
    x, inv_t = torch.randn(40, 5000, generator=gen), torch.rand(40, generator=gen) + 0.5
    u = torch.rand(40, generator=gen)
    none = ops.sample_filtered(x, inv_t, torch.full((40,), -1), torch.ones(40), torch.zeros(40), u)
    assert torch.equal(none, ops.sample_from_logits(x, inv_t, u))


def test_a_row_ignores_its_batch_and_bad_arguments() -> None:
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(30, 4000, generator=gen) * 2
    inv_t, u = torch.rand(30, generator=gen) + 0.5, torch.rand(30, generator=gen)
    k, p, m = _filters(30, 4000, gen)
    together = ops.sample_filtered(logits, inv_t, k, p, m, u)
    alone = torch.cat([ops.sample_filtered(logits[i : i + 1], inv_t[i : i + 1], k[i : i + 1], p[i : i + 1],
                                           m[i : i + 1], u[i : i + 1]) for i in range(30)])
    assert torch.equal(together, alone)
    for bad in ((logits.double(), inv_t, k, p, m, u), (logits, inv_t, k.int(), p, m, u),
                (logits, inv_t, k, p[:29], m, u), (torch.empty(30, 0), inv_t, k, p, m, u)):
        with pytest.raises(ValueError):
            ops.sample_filtered(*bad)
