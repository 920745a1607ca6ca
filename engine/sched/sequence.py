"""Request and sequence state. A request (one prompt) owns one or more sequences: n parallel
samples, best_of candidates or beams, which share KV blocks copy-on-write."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from common.block_hash import adapter_root
from common.pooling_params import PoolingParams
from common.sampling_params import SamplingParams


class TokenConstraint(Protocol):
    """A sequence's grammar state (structured output): it follows the sequence's output tokens.
    The implementation lives in `engine.sample.grammar`; the scheduler only feeds and forks it."""

    def consume(self, token_id: int) -> bool:
        """Advance by one sampled token; False when the grammar rejects it."""
        ...

    def fork(self) -> TokenConstraint:
        """An independent copy in the same state (for a forked sequence)."""
        ...


class BeamSearch(Protocol):
    """A request's beam search as the scheduler sees it: whether it is over, and its best
    finished beams. The implementation is `engine.sample.beam_search.BeamSearchState`; the
    sampling stage steps a copy of it, the scheduler keeps the new state and only asks."""

    @property
    def is_done(self) -> bool: ...

    def best(self, n: int) -> list[tuple[list[int], float]]:
        """The `n` best beams as (output token ids, score), best first."""
        ...


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


_seq_ids = itertools.count()


def sample_stream(index: int) -> str:
    """The name sample `index`'s random draws are keyed by, with the seed and the token index.
    Not the request id, so one seed reproduces one output across requests (as OpenAI's `seed`
    promises); an unseeded request gets a seed derived from its id at admission, carried in
    its params, so a preempted or resumed request continues exactly."""
    return f"sample/{index}"


@dataclass(slots=True, eq=False, kw_only=True)
class Sequence:
    """One token stream. `num_computed` tokens have K/V in the cache; the rest are scheduled."""

    request: Request
    index: int
    token_ids: list[int]
    num_prompt_tokens: int
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    num_computed: int = 0
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None
    cumulative_logprob: float = 0.0
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    num_emitted: int = 0
    grammar: TokenConstraint | None = None
    keep_kv_below: int = 0  # recomputed prefix-cache hits (prompt logprobs): K/V stays as cached

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    @property
    def stream(self) -> str:
        """What its random draws are keyed by: `sample_stream(index)`."""
        return sample_stream(self.index)

    def fork(self, index: int) -> Sequence:
        """A copy with a new id (the block manager forks the blocks)."""
        return Sequence(
            request=self.request,
            index=index,
            token_ids=list(self.token_ids),
            num_prompt_tokens=self.num_prompt_tokens,
            num_computed=self.num_computed,
            status=self.status,
            cumulative_logprob=self.cumulative_logprob,
            logprobs=list(self.logprobs),
            grammar=None if self.grammar is None else self.grammar.fork(),
        )


@dataclass(slots=True, eq=False, kw_only=True)
class Request:
    """A prompt and its sampling parameters; the scheduler's unit of admission and preemption."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    seqs: list[Sequence] = field(default_factory=list)
    beam: BeamSearch | None = None
    num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache at first admission
    first_token_time: float | None = None
    finish_time: float | None = None
    error: str | None = None
    error_code: str | None = None
    # prompt logprobs (SamplingParams.prompt_logprobs): gathered chunk by chunk, sent once
    prompt_logprobs: list[dict[str, Any] | None] | None = None
    prompt_logprobs_sent: bool = False
    # recomputed forks without prefix caching: the others share the prompt's first full blocks of
    # `prefix_donor` and run none of their tokens until it has computed those `num_shared_prefix`
    prefix_donor: Sequence | None = None
    num_shared_prefix: int = 0
    lora_name: str | None = None  # its LoRA adapter (None: the base model)
    # an embedding request (a pooling engine): its prompt is prefilled, then it finishes with its
    # pooled vector and no token; its `pooling_type` is the engine's, set at admission
    pooling: PoolingParams | None = None

    @property
    def prefix_root(self) -> int | None:
        """The parent key of its first KV block: its adapter's, so adapters never share K/V."""
        return adapter_root(self.lora_name)

    @property
    def recomputes_cached_prefix(self) -> bool:
        """Prompt rows found in the prefix cache are run again (their K/V kept as cached): their
        hidden states are needed, for prompt logprobs or for pooling over more than the last row."""
        return self.needs_prompt_logprobs or (self.pooling is not None and self.pooling.pooling_type != "LAST")

    @property
    def needs_prompt_logprobs(self) -> bool:
        """True until every prompt position's logprob has been computed."""
        if self.params.prompt_logprobs is None or self.prompt_logprobs_sent:
            return False
        return self.prompt_logprobs is None or len(self.prompt_logprobs) < len(self.prompt_token_ids)

    def unfinished_seqs(self) -> list[Sequence]:
        return [seq for seq in self.seqs if not seq.is_finished]

    @property
    def num_seqs_at_peak(self) -> int:
        """Sequences this request will run at once: before its first token, the n / best_of /
        beam width it forks into then; after, its unfinished ones. Admission counts this against
        `max_num_seqs`, so a queue of n = 16 requests cannot become sixteen times the sequences it allows."""
        unfinished = len(self.unfinished_seqs())
        if self.first_token_time is None and self.beam is None:
            return max(unfinished, self.params.num_candidates)
        return unfinished

    @property
    def is_finished(self) -> bool:
        if self.beam is not None:
            return self.beam.is_done or not self.unfinished_seqs()
        return bool(self.seqs) and not self.unfinished_seqs()

    @property
    def needs_fork(self) -> bool:
        """True while one sequence stands for a request that will run several."""
        return len(self.seqs) == 1 and self.params.num_candidates > 1 and self.seqs[0].num_output_tokens == 0
