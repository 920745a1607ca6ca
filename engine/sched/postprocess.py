"""After the model and the sampler: the one place a step's results change sequence state.

In this order: computed-token counts and the prefix cache, prompt logprobs, sampled tokens
(a request of n > 1 forks its candidates at its first token), beam searches (their new state,
forks and frees),
stops, then one delta per touched request. A request of n = 2 at its first token::

    samples   seqs=[s0]  token_ids=[[t_a, t_b]]       (one row, one token per candidate)
    s0 ── fork ──▶ s1       (s1 shares every block of s0, copy-on-write)
    s0 += t_a, s1 += t_b    then each is checked for a stop on its own

A verified speculative row (`StepSamples.spec`) keeps the K/V of its last token and of the
accepted proposals only: the sequence's blocks are cut back to that (`BlockManager.truncate`)
before the prefix cache sees them, then its tokens are appended one by one, stopping at the
first stop.

It frees nothing itself: `update` returns the sequences and requests that finished
(`StepUpdate`), and the scheduler, which owns the queues, releases them.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from engine.kv.block_manager import BlockManager
from engine.outputs import CompletionOutput, RequestOutput
from engine.sched.output import BeamChoice, SchedulerOutput, StepSamples
from engine.sched.sequence import Request, SeqStatus, Sequence


@dataclass(slots=True)
class StepUpdate:
    """What one step's results did: the deltas to send, and what the scheduler must release."""

    outputs: list[RequestOutput] = field(default_factory=list)
    finished_seqs: list[Sequence] = field(default_factory=list)  # their blocks go back to the pool
    finished_requests: list[Request] = field(default_factory=list)  # leave the running queue


class Postprocessor:
    """Applies `StepSamples` to the scheduler's sequences and builds the step's deltas."""

    def __init__(self, block_manager: BlockManager, eos_token_ids: set[int], max_model_len: int) -> None:
        self.block_manager = block_manager
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.finished: Counter[str] = Counter()
        self._update = StepUpdate()

    def update(self, sched: SchedulerOutput, samples: StepSamples) -> StepUpdate:
        """Apply one step's samples; the deltas and what finished (nothing is freed here)."""
        self._update = update = StepUpdate()
        update.outputs = self._apply(sched, samples)
        self._update = StepUpdate()
        return update

    def _apply(self, sched: SchedulerOutput, samples: StepSamples) -> list[RequestOutput]:
        outputs = [self._reject(request) for request in sched.rejected]
        accepted = {result.seq.seq_id: result.num_accepted for result in samples.spec}
        for item in sched.scheduled:
            seq = item.seq
            if item.num_spec:
                seq.num_computed += len(item.token_ids) - item.num_spec + accepted[seq.seq_id]
                self.block_manager.truncate(seq.seq_id, seq.num_computed)
            else:
                seq.num_computed += len(item.token_ids)
            self.block_manager.mark_computed(seq.seq_id, seq.num_computed)
        touched: dict[str, Request] = {}
        for item in sched.scheduled:  # a pooling request ends when its prompt is computed
            seq = item.seq
            if seq.request.pooling is not None and not seq.is_finished and seq.num_computed >= len(seq.token_ids):
                self.finish_seq(seq, "stop")
                touched[seq.request.request_id] = seq.request
        for request_id, (start, entries) in samples.prompt_logprobs.items():
            request = self._request_of(sched, request_id)
            gathered = request.prompt_logprobs or []
            request.prompt_logprobs = gathered[: start + 1 if start else 0] + entries
        self._append_samples(samples, touched)
        self._append_spec(samples, touched)
        for choice in samples.beams:
            touched[choice.request.request_id] = choice.request
            self._apply_beams(choice)
        outputs += [out for request in touched.values() if (out := self._output(request)) is not None]
        return outputs

    # ----- tokens --------------------------------------------------------------------------
    def _append_samples(self, samples: StepSamples, touched: dict[str, Request]) -> None:
        logprobs, top = samples.logprobs, samples.top_logprobs
        now = time.monotonic()
        for row, (seq, tokens) in enumerate(zip(samples.seqs, samples.token_ids, strict=True)):
            request = seq.request
            touched[request.request_id] = request
            if request.first_token_time is None:
                request.first_token_time = now
            if len(tokens) == 1:
                self.append_token(seq, tokens[0], logprobs[row][0] if logprobs is not None else 0.0,
                                  top[row][0] if row in top else None)
                continue
            targets = [seq, *self._fork(seq, len(tokens) - 1)]
            for k, (target, token) in enumerate(zip(targets, tokens, strict=True)):
                self.append_token(target, token, logprobs[row][k] if logprobs is not None else 0.0,
                                  top[row][k] if row in top else None)

    def _append_spec(self, samples: StepSamples, touched: dict[str, Request]) -> None:
        now = time.monotonic()
        for result in samples.spec:
            seq, request = result.seq, result.seq.request
            touched[request.request_id] = request
            if request.first_token_time is None:
                request.first_token_time = now
            for j, token in enumerate(result.tokens):
                self.append_token(seq, token, result.logprobs[j] if result.logprobs is not None else 0.0,
                                  result.top_logprobs[j] if result.top_logprobs is not None else None)
                if seq.is_finished:
                    break

    def _fork(self, parent: Sequence, count: int) -> list[Sequence]:
        """`count` children sharing the parent's blocks (before the parent's token is appended)."""
        children = []
        for k in range(1, count + 1):
            child = parent.fork(k)
            self.block_manager.fork(parent.seq_id, child.seq_id)
            parent.request.seqs.append(child)
            children.append(child)
        return children

    def append_token(self, seq: Sequence, token_id: int, logprob: float = 0.0,
                     top_logprobs: list[tuple[int, float]] | None = None) -> None:
        """Add a sampled token to a sequence (and its grammar); finish it when a stop holds."""
        seq.token_ids.append(token_id)
        seq.cumulative_logprob += logprob
        if seq.request.params.logprobs is not None:
            seq.logprobs.append({"token_id": token_id, "logprob": logprob, "top_logprobs": top_logprobs or []})
        rejected = seq.grammar is not None and not seq.grammar.consume(token_id)
        reason = "stop" if rejected else self.stop_reason(seq, token_id)
        if reason is not None:
            self.finish_seq(seq, reason)

    def stop_reason(self, seq: Sequence, token_id: int) -> str | None:
        params = seq.request.params
        num_out = len(seq.token_ids) - seq.num_prompt_tokens
        if num_out >= params.min_tokens:
            if token_id in params.stop_token_ids:
                return "stop"
            if not params.ignore_eos and token_id in self.eos_token_ids:
                return "stop"
        if num_out >= params.max_tokens or len(seq.token_ids) >= self.max_model_len:
            return "length"
        return None

    def finish_seq(self, seq: Sequence, reason: str) -> None:
        """Set the sequence's one finish reason; its blocks are released after the step."""
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        self._update.finished_seqs.append(seq)

    def _apply_beams(self, choice: BeamChoice) -> None:
        """Keep the search's new state, fork parents chosen more than once, free parents nobody
        chose, append the tokens."""
        request = choice.request
        request.beam = choice.search
        if request.first_token_time is None:
            request.first_token_time = time.monotonic()
        beams = request.unfinished_seqs()
        used: set[int] = set()
        next_beams: list[tuple[Sequence, int]] = []
        for index, (parent, token) in enumerate(choice.chosen):
            if parent.seq_id in used:
                child = parent.fork(index)
                self.block_manager.fork(parent.seq_id, child.seq_id)
                next_beams.append((child, token))
            else:
                used.add(parent.seq_id)
                next_beams.append((parent, token))
        for seq in beams:
            if seq.seq_id not in used:
                self.finish_seq(seq, "beam")
        for index, (seq, token) in enumerate(next_beams):
            seq.index = index
            seq.token_ids.append(token)
        request.seqs = [seq for seq, _ in next_beams] + [s for s in request.seqs if s.is_finished]
        if choice.done:
            for seq, _ in next_beams:
                self.finish_seq(seq, "beam")

    # ----- deltas --------------------------------------------------------------------------
    def _reject(self, request: Request) -> RequestOutput:
        self.finished["error"] += 1
        return RequestOutput(request_id=request.request_id, finished=True, error=request.error,
                             error_code=request.error_code, num_prompt_tokens=len(request.prompt_token_ids))

    def _output(self, request: Request) -> RequestOutput | None:
        finished = request.is_finished
        params = request.params
        if request.pooling is not None:  # no tokens: the finish alone (the engine attaches the vector)
            outputs = [CompletionOutput(index=0, token_ids=[], finish_reason="stop")] if finished else []
        elif not params.use_beam_search and params.num_candidates == params.n:
            outputs = [self._delta(seq) for seq in request.seqs if seq.num_emitted < seq.num_output_tokens]
        elif finished:
            outputs = self._beam_outputs(request) if request.beam else self._best_of(request)
        else:
            return None
        if finished:
            request.finish_time = time.monotonic()
            self._update.finished_requests.append(request)
            self.finished[outputs[0].finish_reason or "stop" if outputs else "stop"] += 1
        if not outputs and not finished:
            return None
        out = RequestOutput(
            request_id=request.request_id, outputs=outputs, finished=finished,
            num_prompt_tokens=len(request.prompt_token_ids),
            num_generated_tokens=sum(seq.num_output_tokens for seq in request.seqs),
            num_cached_tokens=request.num_cached_tokens or 0,
        )
        if params.prompt_logprobs is not None and not request.prompt_logprobs_sent:
            out.prompt_logprobs = request.prompt_logprobs or [None]
            request.prompt_logprobs_sent = True
        return out

    def _delta(self, seq: Sequence) -> CompletionOutput:
        start, seq.num_emitted = seq.num_emitted, seq.num_output_tokens
        logprobs = seq.logprobs[start:] if seq.request.params.logprobs is not None else None
        return CompletionOutput(index=seq.index, token_ids=seq.output_token_ids[start:],
                                finish_reason=seq.finish_reason, logprobs=logprobs,
                                cumulative_logprob=seq.cumulative_logprob)

    def _best_of(self, request: Request) -> list[CompletionOutput]:
        ranked = sorted(request.seqs, key=lambda s: s.cumulative_logprob, reverse=True)[: request.params.n]
        logprobs = request.params.logprobs is not None
        return [CompletionOutput(index=index, token_ids=seq.output_token_ids, finish_reason=seq.finish_reason,
                                 logprobs=seq.logprobs if logprobs else None, cumulative_logprob=seq.cumulative_logprob)
                for index, seq in enumerate(ranked)]

    def _beam_outputs(self, request: Request) -> list[CompletionOutput]:
        """The n best hypotheses, best first."""
        assert request.beam is not None
        out = []
        for index, (tokens, score) in enumerate(request.beam.best(request.params.n)):
            reason = "stop" if tokens and tokens[-1] in self.eos_token_ids else "length"
            out.append(CompletionOutput(index=index, token_ids=list(tokens), finish_reason=reason, logprobs=None,
                                        cumulative_logprob=float(score)))
        return out

    @staticmethod
    def _request_of(sched: SchedulerOutput, request_id: str) -> Request:
        return next(s.seq.request for s in sched.scheduled if s.seq.request.request_id == request_id)
