"""The step plan (`engine.sample.step_plan`) for a step that mixes every kind of row: which rows
need their logits, each logits row's width, the picker's random rows and their keys, the
speculative positions' picker and the ranges that need logits; and the beam step, which returns
the search's new state and leaves the request's own alone."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from common.sampling_params import SamplingParams
from engine.sample.beam_search import BeamSearchState
from engine.sample.beam_step import beam_step
from engine.sample.sampler import uniform
from engine.sample.step_plan import BEAM, StepPlan, plan_step
from engine.sched.output import ScheduledSeq
from engine.sched.sequence import Request, Sequence

EOS = [2]
PROMPT = [5, 6, 7, 8]


class Anything:
    """A grammar that allows every token (a real `TokenConstraint`: the plan only asks whether a
    row has one)."""

    def consume(self, token_id: int) -> bool:
        return True

    def fork(self) -> Anything:
        return Anything()


def _seq(name: str, outputs: int = 3, **params: Any) -> Sequence:
    request = Request(request_id=name, prompt_token_ids=list(PROMPT),
                      params=SamplingParams(**({"max_tokens": 16, "temperature": 0.0} | params)))
    seq = Sequence(request=request, index=0, token_ids=PROMPT + list(range(20, 20 + outputs)),
                   num_prompt_tokens=len(PROMPT))
    request.seqs.append(seq)
    return seq


def _decode(seq: Sequence) -> ScheduledSeq:
    n = len(seq.token_ids)
    return ScheduledSeq(seq=seq, token_ids=[seq.token_ids[-1]], start=n - 1, block_table=[0], sample=True)


def _spec(seq: Sequence, proposals: list[int]) -> ScheduledSeq:
    n = len(seq.token_ids)
    return ScheduledSeq(seq=seq, token_ids=[seq.token_ids[-1], *proposals], start=n - 1, block_table=[0],
                        sample=False, num_spec=len(proposals))


def _prefill(seq: Sequence, prompt_logits: int = 0, last: bool = True) -> ScheduledSeq:
    count = len(PROMPT) if last else 2
    return ScheduledSeq(seq=seq, token_ids=seq.token_ids[:count], start=0, block_table=[0], sample=last,
                        num_prompt_logits=prompt_logits)


def test_a_mixed_step_is_planned_row_by_row() -> None:
    greedy = _seq("greedy")
    sampled = _seq("sampled", temperature=0.8, seed=7, top_k=5)
    grammar = _seq("grammar", temperature=0.8, seed=1)
    grammar.grammar = Anything()
    logprobs = _seq("logprobs", logprobs=2)
    penalized = _seq("penalized", repetition_penalty=1.3)
    prompt_lp = _seq("prompt-lp", outputs=0, prompt_logprobs=1)
    middle = _seq("middle", outputs=0)  # a chunk that stops before the prompt's end: no sample
    forked = _seq("forked", outputs=0, n=2, temperature=1.0, seed=3)
    beam_a = _seq("beam", n=2, use_beam_search=True, temperature=0.0)
    beam_b = beam_a.fork(1)
    beam_a.request.seqs.append(beam_b)
    spec_greedy, spec_seeded, spec_lp = _seq("sg"), _seq("ss", temperature=0.9, seed=4), _seq("sl", logprobs=0)
    scheduled = [
        _decode(greedy), _decode(sampled), _decode(grammar), _spec(spec_greedy, [30, 31]),
        _prefill(prompt_lp, prompt_logits=3), _decode(logprobs), _spec(spec_seeded, [32, 33, 34]),
        _decode(penalized), _prefill(middle, last=False), _prefill(forked), _decode(beam_a), _decode(beam_b),
        _spec(spec_lp, [35]),
    ]
    plan = plan_step(scheduled, EOS)

    # rows in the runner's order: prefills first; the middle chunk and the speculative rows do not sample
    assert [s.seq.request.request_id for s in plan.sampling] == [
        "prompt-lp", "forked", "greedy", "sampled", "grammar", "logprobs", "penalized", "beam", "beam"]
    assert plan.logit_rows == (1, 4, 5, 6, 7, 8)  # n > 1, grammar, logprobs, a penalty, beams
    assert plan.widths == (2, 1, 1, 1, BEAM, BEAM)  # n = 2 forks at its first token
    assert plan.picked_rows == [0, 2, 3]  # prompt-logprob chunk (greedy), greedy, sampled
    assert plan.picker is not None and plan.picker.random_rows == [2]  # numbered among the picked rows
    assert plan.picker.draws.uniforms == [uniform(7, "sample/0", 3)]
    assert plan.picker.draws.filtered and plan.picker.draws.filters[0][0] == 5  # top_k travels with the row

    assert [s.seq.request.request_id for s in plan.spec] == ["sg", "ss", "sl"]
    assert plan.spec_picker.random_rows == [3, 4, 5, 6]  # the seeded row's 1 + 3 positions
    assert plan.spec_picker.draws.uniforms == [uniform(4, "sample/0", 3 + j) for j in range(4)]
    assert dict(plan.spec_logit_ranges) == {2: (7, 9)}  # logprobs: its positions' logits


def test_every_row_takes_the_logits_path_when_tokens_are_not_picked() -> None:
    seqs = [_seq("a"), _seq("b", temperature=0.7, seed=1)]
    plan = plan_step([_decode(s) for s in seqs], EOS, pick_tokens=False)
    assert plan.logit_rows == (0, 1) and plan.widths == (1, 1) and plan.picker is None
    assert plan.picked_rows == []
    only_logits = plan_step([_decode(_seq("c", logprobs=1))], EOS)
    assert only_logits.picker is None and only_logits.logit_rows == (0,)
    only_picked = plan_step([_decode(_seq("d"))], EOS)
    assert only_picked.logit_rows == () and only_picked.picker is not None
    assert only_picked.spec == () and only_picked.spec_picker.random_rows == []


def test_the_plan_is_frozen() -> None:
    plan = plan_step([_decode(_seq("e"))], EOS)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.logit_rows = ()  # type: ignore[misc]
    with pytest.raises(TypeError):
        plan.spec_logit_ranges[0] = (0, 1)  # type: ignore[index]
    assert isinstance(StepPlan(), StepPlan)


def test_a_beam_step_returns_the_new_search_and_leaves_the_requests_alone() -> None:
    seq = _seq("beam", outputs=0, n=2, use_beam_search=True, temperature=0.0, max_tokens=8)
    request = seq.request
    logits = torch.log_softmax(torch.linspace(0.0, 3.0, 12).reshape(1, 12), dim=-1)
    first = beam_step(request, [(seq, 0)], logits, set(EOS))
    assert request.beam is None  # the scheduler's post-processing keeps `first.search`
    assert isinstance(first.search, BeamSearchState) and first.search.num_generated == 1
    assert [token for _, token in first.chosen] == [11, 10]
    request.beam = first.search
    beams = [seq, seq.fork(1)]
    request.seqs.append(beams[1])
    before = first.search.best(2)
    again = beam_step(request, [(beams[0], 0), (beams[1], 1)], logits.expand(2, 12), set(EOS))
    assert request.beam is first.search and first.search.best(2) == before and first.search.num_generated == 1
    assert isinstance(again.search, BeamSearchState) and again.search.num_generated == 2
    assert [len(tokens) for tokens, _ in again.search.best(2)] == [2, 2]
