"""The data a step hands between its stages, torch-free.

    Scheduler.schedule() ──SchedulerOutput──▶ plan_step (engine.sample.step_plan) ──StepPlan──▶
    ModelRunner.execute() ──ModelOutput──▶ SampleStage (engine.sample: every token, verification too) ──StepSamples──▶
    Scheduler.update_from_output()   (the one place sequence and request state changes after a step)

The runner reads only the plain fields of `ScheduledSeq` (never `seq`, never the block manager)
and the step's plan; the plan and the sampling stage read `seq` for its parameters and history
but change nothing; the scheduler applies what `StepSamples` says (beam searches included)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.sched.sequence import BeamSearch, Request, Sequence


@dataclass(slots=True, kw_only=True)
class ScheduledSeq:
    """`token_ids` (positions `start` .. `start + len - 1` of `seq`) run this step.

    `block_table` is the sequence's live table (read only). `sample`: the chunk ends at the
    sequence's last token, so its last row's logits choose the next token. Positions below
    `write_from` keep the K/V already in their (prefix-cached, shared) blocks: the runner gives
    them slot -1. `num_prompt_logits` rows from the chunk's start predict prompt tokens and
    are kept for prompt logprobs (0 when not asked). `num_spec` > 0: a speculative row, the last
    `num_spec` tokens are proposals (not in `seq.token_ids`); every one of its 1 + num_spec
    positions attends as a decode row and yields a target token (`engine.sample.verify`); `sample`
    is False."""

    seq: Sequence
    token_ids: list[int]
    start: int
    block_table: list[int]
    sample: bool
    write_from: int = 0
    num_prompt_logits: int = 0
    num_spec: int = 0
    lora_name: str | None = None  # the request's LoRA adapter (the runner gives its rows the adapter's slot)

    @property
    def seq_id(self) -> int:
        return self.seq.seq_id

    @property
    def num_new(self) -> int:
        return len(self.token_ids)


def is_prefill(s: ScheduledSeq) -> bool:
    """A prefill chunk: more than one new token, or a prompt token (a chunk of one that chunked
    prefill left: it keeps the prompt rows' arithmetic, `LinearRows.exact_rows`); not a speculative row
    (those attend as decodes)."""
    return (len(s.token_ids) > 1 or s.start < s.seq.num_prompt_tokens) and not s.num_spec


def batch_order(scheduled: list[ScheduledSeq]) -> list[ScheduledSeq]:
    """The step's rows as the runner lays them out: prefill chunks first, then decodes and
    speculative rows (in scheduled order). The step plan numbers its rows in this order."""
    return [s for s in scheduled if is_prefill(s)] + [s for s in scheduled if not is_prefill(s)]


@dataclass(slots=True)
class SchedulerOutput:
    """One step's work: scheduled chunks (prefills first is the runner's business), block moves
    to do before the model runs, and requests refused for good."""

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    rejected: list[Request] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def num_decodes(self) -> int:
        return sum(1 for s in self.scheduled if len(s.token_ids) == 1)


@dataclass(slots=True, kw_only=True)
class BeamChoice:
    """One beam-search request's step: the new running beams as (parent sequence, token); a
    parent chosen twice is forked, a parent nobody chose is freed; `done` ends the search;
    `search` is its state after the step (the request keeps it)."""

    request: Request
    chosen: list[tuple[Sequence, int]]
    done: bool
    search: BeamSearch


@dataclass(slots=True, kw_only=True)
class SpecResult:
    """A verified speculative row: `tokens` (accepted proposals, then the target's token) go to
    `seq`; `num_accepted` of its `num_proposed` proposals were right; with their logprobs when the
    request asks for them."""

    seq: Sequence
    tokens: list[int]
    num_accepted: int
    num_proposed: int
    # per token of `tokens`, for a request that asks for logprobs: its logprob and top alternatives
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass(slots=True, kw_only=True)
class StepSamples:
    """What sampling chose, row by row (`seqs[i]` gets `token_ids[i]`: one token, or one per
    candidate when a request of n > 1 forks at its first token)."""

    seqs: list[Sequence] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] | None = None  # same shape, when some row needs them
    top_logprobs: dict[int, list[list[tuple[int, float]]]] = field(default_factory=dict)  # row -> per token
    beams: list[BeamChoice] = field(default_factory=list)
    # request id -> (chunk start, entries for prompt tokens start+1 ...; a leading None when start is 0)
    prompt_logprobs: dict[str, tuple[int, list[dict[str, Any] | None]]] = field(default_factory=dict)
    spec: list[SpecResult] = field(default_factory=list)  # verified speculative rows
