"""Inverse-CDF sampling kernel (`ops.sample_from_logits`) against the torch reference: the same token
for every row whose uniform is not within rounding of a boundary, masked tokens never, exact
quantiles of known distributions, and rows independent of their batch."""

from __future__ import annotations

import itertools

import pytest
import torch

import ops
from ops import reference

VOCABS = [1, 7, 8, 255, 256, 257, 1000, 49152]
ROWS = [1, 3, 17, 64]
LAST_UNIFORM = 1.0 - 2.0**-23  # the largest uniform the engine draws


def _inputs(rows: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen) * 4
    inv_t = 1.0 / (torch.rand(rows, generator=gen) * 2.0 + 0.2)
    uniforms = torch.rand(rows, generator=gen)
    uniforms[0] = LAST_UNIFORM
    if rows > 1:
        uniforms[1] = 0.0
    return logits, inv_t, uniforms


def _near_boundary(logits: torch.Tensor, inv_t: torch.Tensor, u: torch.Tensor, token: int) -> bool:
    """The reference CDF passes the target within float rounding of this token's edges."""
    cdf = torch.softmax(logits.double() * float(inv_t), dim=-1).cumsum(dim=-1)
    target = float(u) * float(cdf[-1])
    edges = [float(cdf[token])] + ([float(cdf[token - 1])] if token else [])
    return min(abs(e - target) for e in edges) < 1e-5


@pytest.mark.parametrize(("rows", "vocab"), list(itertools.product(ROWS, VOCABS)))
def test_kernel_matches_reference(rows: int, vocab: int) -> None:
    logits, inv_t, uniforms = _inputs(rows, vocab, rows * 1000 + vocab)
    got = ops.sample_from_logits(logits, inv_t, uniforms)
    expected = reference.sample_from_logits(logits, inv_t, uniforms)
    assert got.dtype == torch.int64 and got.shape == (rows,)
    assert bool(((got >= 0) & (got < vocab)).all())
    for r in (got != expected).nonzero().flatten().tolist():
        assert _near_boundary(logits[r], inv_t[r], uniforms[r], int(expected[r])), (r, got[r], expected[r])


def test_masked_tokens_are_never_drawn() -> None:
    vocab, allowed = 3000, [5, 700, 2999]
    logits = torch.full((1, vocab), float("-inf"))
    logits[0, allowed] = torch.tensor([0.0, 3.0, -20.0])  # the last one nearly weightless
    uniforms = torch.tensor([0.0, 1e-7, 0.3, 0.5, 0.9, 0.999999, LAST_UNIFORM])
    many = logits.expand(len(uniforms), -1).contiguous()
    got = ops.sample_from_logits(many, torch.ones(len(uniforms)), uniforms)
    assert set(got.tolist()) <= set(allowed)
    assert got[0] == 5 and got[-1] != 5


def test_uniform_grid_gives_exact_quantiles() -> None:
    """Uniforms at the midpoints of N equal cells: token k comes p_k * N times (to one cell)."""
    probs = torch.tensor([0.1, 0.0, 0.25, 0.05, 0.6])
    n = 2000
    logits = torch.log(probs).expand(n, -1).contiguous()
    uniforms = (torch.arange(n, dtype=torch.float32) + 0.5) / n
    got = ops.sample_from_logits(logits, torch.ones(n), uniforms)
    counts = torch.bincount(got, minlength=len(probs)).float()
    assert counts[1] == 0
    assert torch.allclose(counts, probs * n, atol=1.0)


def test_temperature_sharpens_and_flattens() -> None:
    logits = torch.tensor([[0.0, 1.0]]).expand(1000, -1).contiguous()
    uniforms = (torch.arange(1000, dtype=torch.float32) + 0.5) / 1000
    cold = ops.sample_from_logits(logits, torch.full((1000,), 4.0), uniforms).float().mean()
    hot = ops.sample_from_logits(logits, torch.full((1000,), 0.25), uniforms).float().mean()
    exact = torch.sigmoid(torch.tensor([4.0, 0.25]))
    assert abs(float(cold) - float(exact[0])) < 2e-3 and abs(float(hot) - float(exact[1])) < 2e-3


def test_a_row_ignores_its_batch() -> None:
    logits, inv_t, uniforms = _inputs(64, 49152, 7)
    together = ops.sample_from_logits(logits, inv_t, uniforms)
    alone = torch.cat([ops.sample_from_logits(logits[i : i + 1], inv_t[i : i + 1], uniforms[i : i + 1])
                       for i in range(64)])
    reversed_order = ops.sample_from_logits(logits.flip(0), inv_t.flip(0), uniforms.flip(0)).flip(0)
    assert torch.equal(together, alone) and torch.equal(together, reversed_order)


def test_strided_rows_and_bad_arguments() -> None:
    wide = torch.randn(4, 300)
    logits = wide[:, :257]
    got = ops.sample_from_logits(logits, torch.ones(4), torch.full((4,), 0.5))
    assert torch.equal(got, ops.sample_from_logits(logits.contiguous(), torch.ones(4), torch.full((4,), 0.5)))
    with pytest.raises(ValueError):
        ops.sample_from_logits(logits.double(), torch.ones(4), torch.full((4,), 0.5))
    with pytest.raises(ValueError):
        ops.sample_from_logits(logits, torch.ones(3), torch.full((4,), 0.5))
    with pytest.raises(ValueError):
        ops.sample_from_logits(torch.empty(4, 0), torch.ones(4), torch.full((4,), 0.5))
