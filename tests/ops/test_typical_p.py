"""typical_p (locally typical sampling): the filtered distribution equals Hugging Face's
TypicalLogitsWarper, token for token, (alone, and after its top-k and min-p warpers) on random logits over a grid
of vocabularies, masses and temperatures; typical_p = 1 is the identity; `ops.sample_filtered`
draws typical rows from that distribution (the reference's draw) and leaves the other rows of
the batch exactly as without typical_p."""

from __future__ import annotations

import itertools

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    TopKLogitsWarper,
    TypicalLogitsWarper,
)

import ops
from ops import reference
from ops.reference.sampling import filtered_probs

VOCABS = [7, 257, 1000, 32000]
MASSES = [0.05, 0.2, 0.5, 0.9, 0.95, 0.999]
TEMPERATURES = [0.5, 1.0, 1.7]


def _hf_kept(scaled: torch.Tensor, warpers: LogitsProcessorList) -> torch.Tensor:
    return warpers(None, scaled.clone()) != float("-inf")  # type: ignore[arg-type]


@pytest.mark.parametrize(("vocab", "mass", "temperature"), list(itertools.product(VOCABS, MASSES, TEMPERATURES)))
def test_typical_equals_hf_typical_logits_warper(vocab: int, mass: float, temperature: float) -> None:
    gen = torch.Generator().manual_seed(vocab * 1000 + int(mass * 1000) + int(temperature * 10))
    rows = 8
    logits = torch.randn(rows, vocab, generator=gen) * 3
    inv_t = torch.full((rows,), 1.0 / temperature)
    none_k, none_p, none_m = torch.zeros(rows, dtype=torch.long), torch.ones(rows), torch.zeros(rows)
    ours = filtered_probs(logits, inv_t, none_k, none_p, none_m, torch.full((rows,), mass))
    scaled = logits * inv_t.unsqueeze(1)
    theirs = _hf_kept(scaled, LogitsProcessorList([TypicalLogitsWarper(mass)]))
    assert torch.equal(ours > 0, theirs)  # the same arithmetic in the same order: no rounding apart
    for r in range(rows):
        expected = torch.softmax(scaled[r].masked_fill(~theirs[r], float("-inf")), dim=-1)
        torch.testing.assert_close(ours[r] / ours[r].sum(), expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(("vocab", "mass"), list(itertools.product([257, 1000], [0.3, 0.9])))
def test_typical_after_top_k_and_min_p_equals_hf_in_that_order(vocab: int, mass: float) -> None:
    gen = torch.Generator().manual_seed(vocab + int(mass * 100))
    rows = 6
    logits = torch.randn(rows, vocab, generator=gen) * 3
    inv_t = torch.ones(rows)
    for k, min_p in ((40, 0.0), (0, 0.05), (100, 0.02)):
        ours = filtered_probs(logits, inv_t, torch.full((rows,), k, dtype=torch.long), torch.ones(rows),
                              torch.full((rows,), min_p), torch.full((rows,), mass))
        first = ([TopKLogitsWarper(k)] if k else []) + ([MinPLogitsWarper(min_p)] if min_p else [])
        warpers = LogitsProcessorList([*first, TypicalLogitsWarper(mass)])
        assert torch.equal(ours > 0, _hf_kept(logits, warpers)), (k, min_p)


def test_typical_p_one_is_the_identity() -> None:
    gen = torch.Generator().manual_seed(3)
    rows, vocab = 16, 1000
    logits = torch.randn(rows, vocab, generator=gen) * 3
    inv_t = 1.0 / (torch.rand(rows, generator=gen) + 0.3)
    top_k = torch.where(torch.arange(rows) % 2 == 0, 50, 0)
    top_p = torch.where(torch.arange(rows) % 3 == 0, 0.8, 1.0)
    min_p = torch.where(torch.arange(rows) % 4 == 0, 0.05, 0.0)
    uniforms = torch.rand(rows, generator=gen)
    args = (logits, inv_t, top_k, top_p, min_p)
    assert torch.equal(filtered_probs(*args, torch.ones(rows)), filtered_probs(*args))
    assert torch.equal(ops.sample_filtered(*args, uniforms, torch.ones(rows)), ops.sample_filtered(*args, uniforms))


def test_kernel_entry_draws_typical_rows_from_the_typical_distribution() -> None:
    gen = torch.Generator().manual_seed(11)
    rows, vocab = 64, 500
    logits = torch.randn(rows, vocab, generator=gen) * 3
    inv_t = torch.ones(rows)
    top_k = torch.where(torch.arange(rows) % 3 == 0, 30, 0)
    top_p, min_p = torch.ones(rows), torch.zeros(rows)
    typical = torch.where(torch.arange(rows) % 2 == 0, 0.4, 1.0)
    uniforms = torch.rand(rows, generator=gen)
    got = ops.sample_filtered(logits, inv_t, top_k, top_p, min_p, uniforms, typical)
    rows_typical = (typical < 1).nonzero().squeeze(1)
    rows_plain = (typical == 1).nonzero().squeeze(1)
    expected = reference.sample_filtered(logits, inv_t, top_k, top_p, min_p, uniforms, typical)
    assert torch.equal(got[rows_typical], expected[rows_typical])
    # the other rows: exactly the kernel's draw without typical_p, batch-mates or not
    assert torch.equal(got[rows_plain], ops.sample_filtered(logits, inv_t, top_k, top_p, min_p, uniforms)[rows_plain])
    kept = filtered_probs(logits, inv_t, top_k, top_p, min_p, typical) > 0
    assert bool(kept[torch.arange(rows), got].all())
    assert bool((kept[rows_typical].sum(-1) < (filtered_probs(logits, inv_t, top_k, top_p, min_p) > 0)
                 [rows_typical].sum(-1)).all())  # typical_p cut something in every typical row


def test_the_draw_follows_the_typical_distribution() -> None:
    """Many uniforms on one row: each token's share of the draws is its typical probability."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    n = 4000
    uniforms = (torch.arange(n, dtype=torch.float32) + 0.5) / n
    many = logits.expand(n, -1).contiguous()
    args = (many, torch.ones(n), torch.zeros(n, dtype=torch.long), torch.ones(n), torch.zeros(n))
    tokens = ops.sample_filtered(*args, uniforms, torch.full((n,), 0.6))
    probs = filtered_probs(logits.unsqueeze(0), torch.ones(1), torch.zeros(1, dtype=torch.long), torch.ones(1),
                           torch.zeros(1), torch.full((1,), 0.6))[0]
    probs = probs / probs.sum()
    share = torch.bincount(tokens, minlength=len(logits)).double() / n
    torch.testing.assert_close(share, probs.double(), atol=2.0 / n, rtol=0)
