"""One step's plan, decided once from the scheduler's output, and the model's answer to it.

    SchedulerOutput ──plan_step──▶ StepPlan ──▶ ModelRunner.execute ──ModelOutput──▶ SampleStage ──▶ StepSamples

The plan says, for the rows in the runner's order (`engine.sched.output.batch_order`), what each
one needs: a sampling row either its logits (`needs_logits`: the full path of `SampleStage`) or a
token taken straight from them (`picker`, a `TokenPlan`: greedy or an unfiltered-by-processors
draw); a logits row its sample width (a request of n > 1 forks at its first token) or a beam
search; a speculative row a token at each of its 1 + k positions (`spec_picker`) and, where it
needs them, its positions' logits (`spec_logit_ranges`). The sampling stage asks the model's head
for these (`engine.sample.head`) and the verifier reads them; the runner reads only which chunks
sample and pool. None of them derives these rules again."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType

import torch

from engine.sample.head import LogitsHead
from engine.sample.processors import changes_logits
from engine.sample.sampler import Draws, TokenPlan
from engine.sched.output import ScheduledSeq, batch_order
from engine.sched.sequence import Sequence
from ops.policy import FASTEST, OpsPolicy


class RowKind(Enum):
    """A logit row that is not sampled by a width: it goes to its request's beam search."""

    BEAM = "beam"


BEAM = RowKind.BEAM  # `StepPlan.widths` of a row that goes to its request's beam search
Width = int | RowKind  # a logit row's sample rows (1, or n > 1 at a fork), or `BEAM`


def needs_logits(seq: Sequence, eos_token_ids: list[int]) -> bool:
    """Whether a row's token must come from its logits through the full path (`SampleStage`, or
    for a speculative row `engine.sample.verify.draw_from_logits`) rather than a `TokenPlan`: more
    than one candidate or beams, logprobs, a grammar, or a processor changing its logits now."""
    p = seq.request.params
    return (p.num_candidates != 1 or p.use_beam_search or p.logprobs is not None or seq.grammar is not None
            or changes_logits(seq, eos_token_ids))


@dataclass(frozen=True, slots=True, kw_only=True)
class StepPlan:
    """What one step's rows need (see the module docstring). Row numbers are positions in
    `sampling` (the runner's logits or token rows) and in `spec` (k + 1 positions each)."""

    sampling: tuple[ScheduledSeq, ...] = ()  # the chunks that sample, in the runner's row order
    logit_rows: tuple[int, ...] = ()  # sorted rows of `sampling` that need their logits
    widths: tuple[Width, ...] = ()  # per logit row: the rows it samples (n > 1 at its first token), or BEAM
    picker: TokenPlan | None = None  # the tokens of every other sampling row, in order; None: no such row
    spec: tuple[ScheduledSeq, ...] = ()  # the speculative rows, in the runner's order
    spec_picker: TokenPlan = field(default_factory=lambda: TokenPlan(Draws()))  # every position's token
    # spec row index -> its positions' range among all speculative positions, for rows that need logits
    spec_logit_ranges: Mapping[int, tuple[int, int]] = field(default_factory=lambda: MappingProxyType({}))
    pooling: tuple[ScheduledSeq, ...] = ()  # chunks of pooling requests: their rows' hidden states, no token

    @property
    def picked_rows(self) -> list[int]:
        """The rows of `sampling` whose tokens the picker takes, in order."""
        needs = set(self.logit_rows)
        return [i for i in range(len(self.sampling)) if i not in needs]


def plan_step(scheduled: list[ScheduledSeq], eos_token_ids: list[int], pick_tokens: bool = True,
              policy: OpsPolicy = FASTEST) -> StepPlan:
    """The plan of a step's scheduled chunks. `pick_tokens` False: every sampling row takes the
    full logits path (the picker's rows give the same tokens either way; tests compare them).
    `policy`: the engine's, which the pickers' draws run under."""
    order = batch_order(scheduled)
    sampling = tuple(s for s in order if s.sample)
    spec = tuple(s for s in order if s.num_spec)
    logit_rows: list[int] = []
    draws = Draws()  # numbered among the picked rows
    for i, item in enumerate(sampling):
        seq = item.seq
        if not pick_tokens or needs_logits(seq, eos_token_ids):
            logit_rows.append(i)
        else:
            draws.add(i - len(logit_rows), seq.request.params, seq.stream, seq.num_output_tokens)
    picker = TokenPlan(draws, policy) if len(logit_rows) < len(sampling) else None
    widths = tuple(_width(sampling[i].seq) for i in logit_rows)
    pooling = tuple(s for s in order if s.seq.request.pooling is not None)
    return StepPlan(sampling=sampling, logit_rows=tuple(logit_rows), widths=widths, picker=picker, spec=spec,
                    spec_picker=_verify_picker(spec, policy),
                    spec_logit_ranges=MappingProxyType(_spec_logit_ranges(spec, eos_token_ids)),
                    pooling=pooling)


def _width(seq: Sequence) -> Width:
    request = seq.request
    if request.params.use_beam_search:
        return BEAM
    return request.params.num_candidates if request.needs_fork else 1


def _verify_picker(items: tuple[ScheduledSeq, ...], policy: OpsPolicy) -> TokenPlan:
    """How to take the target's token at every position of the speculative rows (in order): the
    draw a plain row makes at the output-token index the position will have."""
    draws = Draws()
    row = 0
    for item in items:
        seq = item.seq
        for j in range(item.num_spec + 1):
            draws.add(row, seq.request.params, seq.stream, seq.num_output_tokens + j)
            row += 1
    return TokenPlan(draws, policy)


def _spec_logit_ranges(items: tuple[ScheduledSeq, ...], eos_token_ids: list[int]) -> dict[int, tuple[int, int]]:
    """Item index -> its positions' range among the speculative rows, for the rows that need their
    logits (`needs_logits`, the rule plain rows follow; beams never speculate)."""
    ranges: dict[int, tuple[int, int]] = {}
    offset = 0
    for i, item in enumerate(items):
        if needs_logits(item.seq, eos_token_ids):
            ranges[i] = (offset, offset + item.num_spec + 1)
        offset += item.num_spec + 1
    return ranges


@dataclass(slots=True)
class ModelOutput:
    """The runner's answer to a `StepPlan`: the model's `head` (`engine.sample.head`: the sampling
    stage asks it for logits and tokens), the final-norm hidden states of the plan's sampling rows
    (in order; None without one) and of every speculative position (in order; None without one),
    the hidden states of each chunk's rows that predict prompt tokens (prompt logprobs), and those
    of every row of the plan's pooling chunks."""

    head: LogitsHead
    sample_hidden: torch.Tensor | None = None
    spec_hidden: torch.Tensor | None = None
    prompt_hidden: list[tuple[ScheduledSeq, torch.Tensor]] = field(default_factory=list)
    pooled_hidden: list[tuple[ScheduledSeq, torch.Tensor]] = field(default_factory=list)  # per `StepPlan.pooling`
