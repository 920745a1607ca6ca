"""Issue 24: the penalty counts kept across steps equal a from-scratch count after many steps,
with sequences joining, growing, forking, finishing and being replaced; the processors give the
same logits with the kept counts as with counts rebuilt every step."""

from __future__ import annotations

import random

import torch

from common.sampling_params import SamplingParams
from engine.sample.penalty_counts import PenaltyCounts
from engine.sample.processors import apply_processors, count_tokens
from engine.sched.sequence import Request, SeqStatus, Sequence

VOCAB = 97


def _seq(rng: random.Random, name: str, params: SamplingParams) -> Sequence:
    prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 30))]
    return Sequence(request=Request(request_id=name, prompt_token_ids=prompt, params=params), index=0,
                    token_ids=list(prompt), num_prompt_tokens=len(prompt))


def _prompt_mask(seqs: list[Sequence]) -> torch.Tensor:
    return count_tokens([s.token_ids[: s.num_prompt_tokens] for s in seqs], VOCAB, torch.device("cpu")) > 0


def test_kept_counts_equal_a_count_from_scratch_over_many_steps() -> None:
    rng = random.Random(0)
    store = PenaltyCounts()
    params = SamplingParams(frequency_penalty=0.5, repetition_penalty=1.3)
    live = [_seq(rng, f"r{i}", params) for i in range(4)]
    made = len(live)
    for step in range(300):
        for seq in live:  # sample one token (sometimes a few: a resumed request brings several)
            seq.token_ids += [rng.randrange(VOCAB) for _ in range(1 if rng.random() < 0.9 else 3)]
        batch = [s for s in live if rng.random() < 0.8]  # some sequences sit a step out (swapped, waiting)
        if not batch:
            continue
        counts, seen = store.gather(batch, VOCAB, torch.device("cpu"), with_prompt=step % 3 != 0)
        want = count_tokens([s.output_token_ids for s in batch], VOCAB, torch.device("cpu"))
        assert torch.equal(counts, want), step
        if seen is not None:
            assert torch.equal(seen, _prompt_mask(batch)), step
        if rng.random() < 0.1:  # one finishes, another arrives
            done = live.pop(rng.randrange(len(live)))
            done.status = SeqStatus.FINISHED
            live.append(_seq(rng, f"r{made}", params))
            made += 1
        if rng.random() < 0.05:  # a fork carries its parent's tokens
            live.append(live[0].fork(len(live)))
        if len(live) > 12:
            live.pop(0).status = SeqStatus.FINISHED
    assert len(store) <= 12 + 1  # finished sequences gave their rows back


def test_processors_match_counts_rebuilt_every_step() -> None:
    rng = random.Random(1)
    kept = PenaltyCounts()
    choices = [SamplingParams(presence_penalty=0.7), SamplingParams(frequency_penalty=-1.2, repetition_penalty=1.5),
               SamplingParams(repetition_penalty=0.8), SamplingParams()]
    seqs = [_seq(rng, f"p{i}", choices[i % len(choices)]) for i in range(6)]
    for _ in range(60):
        logits = torch.randn(len(seqs), VOCAB, generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
        fresh = logits.clone()
        apply_processors(logits, seqs, [0], kept)
        apply_processors(fresh, seqs, [0])
        assert torch.equal(logits, fresh)
        for seq, row in zip(seqs, logits.argmax(dim=1).tolist(), strict=True):
            seq.token_ids.append(row if rng.random() < 0.5 else rng.randrange(VOCAB))
