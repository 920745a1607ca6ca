"""After the model: sample each row, append the token, fork parallel samples, detect stops,
free finished sequences and turn what changed into per-request deltas."""

from __future__ import annotations

import time
from collections import Counter

import torch

from engine.outputs import CompletionOutput, RequestOutput
from engine.sample.beam_step import beam_outputs, beam_step
from engine.sample.sampler import Sampler, SampleResult, SampleSpec
from engine.sched.scheduler import ScheduledSeq, Scheduler
from engine.sched.sequence import Request, SeqStatus, Sequence, sample_stream


class OutputProcessor:
    """Turns logits into tokens and tokens into RequestOutputs."""

    def __init__(self, scheduler: Scheduler, sampler: Sampler, eos_token_ids: set[int],
                 max_model_len: int) -> None:
        self.scheduler = scheduler
        self.sampler = sampler
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.finished: Counter[str] = Counter()

    def reject(self, request: Request) -> RequestOutput:
        self.finished["error"] += 1
        return RequestOutput(request.request_id, finished=True, error=request.error,
                             num_prompt_tokens=len(request.prompt_token_ids))

    def process(self, sampling: list[ScheduledSeq], logits: torch.Tensor) -> list[RequestOutput]:
        touched: dict[str, Request] = {}
        rows: list[int] = []
        specs: list[SampleSpec] = []
        owners: list[tuple[Sequence, int | None]] = []
        beams: dict[str, list[tuple[Sequence, int]]] = {}
        self._mask_min_tokens(sampling, logits)
        for i, item in enumerate(sampling):
            seq, request = item.seq, item.seq.request
            touched[request.request_id] = request
            if request.params.use_beam_search:
                beams.setdefault(request.request_id, []).append((seq, i))
            elif request.needs_fork:
                for k in range(request.params.num_candidates):
                    rows.append(i)
                    specs.append(SampleSpec.from_params(request.params, sample_stream(k), 0))
                    owners.append((seq, k))
            else:
                rows.append(i)
                specs.append(SampleSpec.from_params(request.params, seq.stream, seq.num_output_tokens))
                owners.append((seq, None))
        if rows:
            results = self.sampler(logits[torch.tensor(rows, device=logits.device)], specs)
            self._apply(owners, results)
        for request_id, items in beams.items():
            beam_step(touched[request_id], items, logits, self)
        return [out for request in touched.values() if (out := self._output(request)) is not None]

    def _mask_min_tokens(self, sampling: list[ScheduledSeq], logits: torch.Tensor) -> None:
        """Below min_tokens, EOS and stop tokens cannot be drawn."""
        for i, item in enumerate(sampling):
            params = item.seq.request.params
            if params.min_tokens and item.seq.num_output_tokens < params.min_tokens:
                banned = list(set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids))
                logits[i, banned] = float("-inf")

    def _apply(self, owners: list[tuple[Sequence, int | None]], results: list[SampleResult]) -> None:
        for (seq, k), result in zip(owners, results, strict=True):
            if k is None or k == 0:
                if k == 0:
                    self._fork_children(seq)
                self.append_token(seq, result)
            else:
                self.append_token(seq.request.seqs[k], result)

    def _fork_children(self, parent: Sequence) -> None:
        request = parent.request
        for k in range(1, request.params.num_candidates):
            child = parent.fork(k)
            self.scheduler.block_manager.fork(parent.seq_id, child.seq_id)
            request.seqs.append(child)

    def append_token(self, seq: Sequence, result: SampleResult) -> None:
        """Add a sampled token to a sequence and finish it when a stop condition holds."""
        request = seq.request
        seq.token_ids.append(result.token_id)
        seq.cumulative_logprob += result.logprob
        if request.params.logprobs is not None:
            seq.logprobs.append({"token_id": result.token_id, "logprob": result.logprob,
                                 "top_logprobs": result.top_logprobs or []})
        if request.first_token_time is None:
            request.first_token_time = time.monotonic()
        reason = self.stop_reason(seq, result.token_id)
        if reason is not None:
            self.finish_seq(seq, reason)

    def stop_reason(self, seq: Sequence, token_id: int) -> str | None:
        params = seq.request.params
        if seq.num_output_tokens >= params.min_tokens:
            if token_id in params.stop_token_ids:
                return "stop"
            if not params.ignore_eos and token_id in self.eos_token_ids:
                return "stop"
        if seq.num_output_tokens >= params.max_tokens or len(seq.token_ids) >= self.max_model_len:
            return "length"
        return None

    def finish_seq(self, seq: Sequence, reason: str) -> None:
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        self.scheduler.free_seq(seq)

    def _output(self, request: Request) -> RequestOutput | None:
        finished = request.is_finished
        params = request.params
        streamable = not params.use_beam_search and params.num_candidates == params.n
        if streamable:
            outputs = [self._delta(seq) for seq in request.seqs if seq.num_emitted < seq.num_output_tokens]
        elif finished:
            outputs = beam_outputs(request, self.eos_token_ids) if request.beam else self._best_of(request)
        else:
            return None
        if finished:
            request.finish_time = time.monotonic()
            self.scheduler.finish_request(request)
            self.finished[outputs[0].finish_reason or "stop" if outputs else "stop"] += 1
        if not outputs and not finished:
            return None
        return RequestOutput(
            request.request_id, outputs, finished, len(request.prompt_token_ids),
            sum(seq.num_output_tokens for seq in request.seqs), request.num_cached_tokens or 0,
        )

    def _delta(self, seq: Sequence) -> CompletionOutput:
        start, seq.num_emitted = seq.num_emitted, seq.num_output_tokens
        logprobs = seq.logprobs[start:] if seq.request.params.logprobs is not None else None
        return CompletionOutput(seq.index, seq.output_token_ids[start:], seq.finish_reason, logprobs,
                                seq.cumulative_logprob)

    def _best_of(self, request: Request) -> list[CompletionOutput]:
        ranked = sorted(request.seqs, key=lambda s: s.cumulative_logprob, reverse=True)[: request.params.n]
        out = []
        for index, seq in enumerate(ranked):
            logprobs = seq.logprobs if request.params.logprobs is not None else None
            out.append(CompletionOutput(index, seq.output_token_ids, seq.finish_reason, logprobs,
                                        seq.cumulative_logprob))
        return out
