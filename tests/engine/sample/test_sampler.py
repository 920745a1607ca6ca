"""Sampler: greedy, filters, seeded batch-independent draws, logprobs, and the drawn distribution."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.sampling_params import SamplingParams
from engine.sample.sampler import Logprobs, Sampler, SamplingBatch
from ops.reference.sampling import TOP_P_PROBE

sampler = Sampler()
GREEDY = SamplingParams(temperature=0.0)


@dataclass(frozen=True)
class SampleResult:
    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]] | None


def _spec(index: int, stream: str = "req", **kwargs: float | int | None) -> tuple[SamplingParams, str, int]:
    return SamplingParams(seed=7, **kwargs), stream, index  # type: ignore[arg-type]


def sample(logits: torch.Tensor, specs: list[tuple[SamplingParams, str, int]]) -> list[SampleResult]:
    """One sampler call on rows described by (params, stream, token index), with logprobs."""
    batch = SamplingBatch([p for p, _, _ in specs], [s for _, s, _ in specs], [i for _, _, i in specs])
    logprobs = Logprobs(logits, batch)
    tokens = sampler(logits.clone(), batch)
    values, tops = logprobs.gather(tokens)
    by_row = {row: (values[j], tops[j]) for j, row in enumerate(logprobs.rows)}
    return [SampleResult(t, by_row.get(i, (0.0, None))[0],
                         by_row[i][1] if i in by_row and specs[i][0].logprobs is not None else None)
            for i, t in enumerate(tokens.tolist())]


def _draws(logits: torch.Tensor, n: int, **kwargs: float | int | None) -> torch.Tensor:
    specs = [_spec(i, **kwargs) for i in range(n)]
    results = sample(logits.expand(n, -1).contiguous(), specs)
    return torch.tensor([r.token_id for r in results])


def test_greedy_is_argmax_first_on_ties() -> None:
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    logits[4, 3] = logits[4, 9] = 100.0
    results = sample(logits, [(GREEDY, "r", 0) for _ in range(5)])
    assert [r.token_id for r in results] == logits.argmax(dim=-1).tolist()
    assert results[4].token_id == 3


def test_top_k_keeps_exactly_the_k_best() -> None:
    logits = torch.tensor([[1.0, 5.0, 0.5, 4.9, 4.8, -2.0]])
    seen = set(_draws(logits, 600, top_k=3).tolist())
    assert seen == {1, 3, 4}


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    logits = torch.log(torch.tensor([[0.05, 0.5, 0.15, 0.3]]))
    assert set(_draws(logits, 600, top_p=0.75).tolist()) == {1, 3}
    assert set(_draws(logits, 600, top_p=0.85).tolist()) == {1, 2, 3}
    assert set(_draws(logits, 600, top_p=0.3).tolist()) == {1}


def test_min_p_drops_tokens_below_fraction_of_best() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.12, 0.08]]))
    assert set(_draws(logits, 600, min_p=0.2).tolist()) == {0, 1, 2}


def test_same_key_same_token_whatever_the_batch() -> None:
    gen = torch.Generator().manual_seed(1)
    vocab = 3000
    target = torch.randn(vocab, generator=gen) * 2
    spec = _spec(11, "req-a/0", temperature=0.9, top_k=500, top_p=0.95)
    alone = sample(target[None], [spec])[0]
    others = [
        (GREEDY, "a", 0),
        _spec(3, "b", temperature=0.5),
        _spec(4, "c", top_k=7),
        _spec(5, "d", top_p=0.999),  # needs the full sort, unlike `spec`
        _spec(6, "e", min_p=0.1, logprobs=5),
    ]
    for position in range(len(others) + 1):
        specs = [*others[:position], spec, *others[position:]]
        rows = [torch.randn(vocab, generator=gen) * 4 for _ in others]
        batch = torch.stack([*rows[:position], target, *rows[position:]])
        result = sample(batch, specs)[position]
        assert result == alone


def test_full_sort_fallback_agrees_with_probe() -> None:
    vocab = 4 * TOP_P_PROBE
    logits = torch.zeros(1, vocab)
    logits[0, :10] = 1.0  # flat tail: top_p=0.99 needs more than the probe holds
    tokens = _draws(logits, 400, top_p=0.99)
    assert int((tokens >= TOP_P_PROBE).sum()) > 0
    small = _draws(logits, 400, top_p=0.001)
    assert set(small.tolist()) <= set(range(10))


def test_different_token_index_varies_the_draw() -> None:
    logits = torch.zeros(1, 64)
    tokens = _draws(logits, 200)
    assert len(set(tokens.tolist())) > 40
    streams = [sample(logits, [_spec(0, f"req-{i}")])[0].token_id for i in range(50)]
    assert len(set(streams)) > 20


def test_logprobs_are_of_the_unmodified_logits() -> None:
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(2)) * 3
    specs = [_spec(0, temperature=0.3, top_k=5, logprobs=4), (SamplingParams(temperature=0.0, logprobs=0), "g", 0),
             _spec(1, best_of=2)]
    results = sample(logits, specs)
    reference = torch.log_softmax(logits, dim=-1)
    for row, result in enumerate(results):
        assert abs(result.logprob - float(reference[row, result.token_id])) < 1e-5
    values, ids = reference[0].topk(4)
    assert [t for t, _ in results[0].top_logprobs or []] == ids.tolist()
    assert torch.allclose(torch.tensor([v for _, v in results[0].top_logprobs or []]), values, atol=1e-5)
    assert results[1].top_logprobs == [] and results[2].top_logprobs is None


def test_a_rows_logprobs_do_not_depend_on_its_batch_or_threads() -> None:
    """Greedy rows with logprobs over a real vocabulary's width, with two threads: each row's logprob
    and top alternatives alone equal, bit for bit, the same row's inside batches of 3 and 8 (a
    row's normalizer summed across threads when the batch had fewer rows than threads)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        gen = torch.Generator().manual_seed(5)
        spec = (SamplingParams(temperature=0.0, logprobs=3), "g", 0)
        for _ in range(30):
            logits = torch.randn(8, 49152, generator=gen) * 3
            batched = sample(logits, [spec] * 8)
            assert sample(logits[:3], [spec] * 3) == batched[:3]
            for row in range(8):
                assert sample(logits[row:row + 1], [spec]) == batched[row:row + 1], row
    finally:
        torch.set_num_threads(threads)


def _chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * tokens.numel()
    return float(((counts - expected) ** 2 / expected).sum())


def test_draws_follow_softmax_of_scaled_logits() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2]])
    draws = _draws(logits, 8000, temperature=0.7)
    probs = torch.softmax(logits[0] / 0.7, dim=-1)
    assert _chi_square(draws, probs) < 24.3  # chi-square, 7 dof, p = 0.001


def test_filtered_draws_follow_renormalized_distribution() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2]])
    draws = _draws(logits, 8000, temperature=1.3, top_k=4)
    kept = torch.tensor([0, 1, 6, 2])
    probs = torch.softmax(logits[0, kept] / 1.3, dim=-1)
    assert set(draws.tolist()) == set(kept.tolist())
    remapped = torch.tensor([kept.tolist().index(t) for t in draws.tolist()])
    assert _chi_square(remapped, probs) < 16.3  # 3 dof, p = 0.001
