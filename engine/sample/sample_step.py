"""One step's sampling: model output → `StepSamples`, changing no sequence (the scheduler's
`update_from_output` applies them).

Rows: each sampling chunk's logits row, except that a request of n > 1 at its first token
samples one row per candidate (the row repeated, keyed by each candidate's stream) and beam
requests go to the beam search. Then: logprobs of the raw rows that ask → penalties, bias,
min_tokens → grammar masks → sampler, each in bulk; one `tolist()` per result tensor.

When every row of a step needs only a token drawn from its own logits (`token_picker`: greedy,
or random without filters), the runner takes the tokens group by group as the lm_head makes the
logits (`LlamaForCausalLM.pick_tokens`) and never keeps the logits matrix."""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.sample.beam_step import beam_step
from engine.sample.grammar import Grammar, GrammarCompiler
from engine.sample.penalty_counts import PenaltyCounts
from engine.sample.processors import apply_processors, changes_logits
from engine.sample.prompt_logprobs import chunk_prompt_logprobs
from engine.sample.sampler import Draws, Logprobs, Sampler, SamplingBatch, TokenPlan
from engine.sched.output import ScheduledSeq, StepSamples
from engine.sched.sequence import Sequence, sample_stream


def needs_logits(seq: Sequence, eos_token_ids: list[int]) -> bool:
    """Whether a row's token must come from its logits through the full path (`SampleStage`, or
    for a speculative row `engine.spec.verify.draw_from_logits`) rather than a `TokenPlan`: more
    than one candidate or beams, logprobs, a grammar, or a processor changing its logits now."""
    p = seq.request.params
    return (p.num_candidates != 1 or p.use_beam_search or p.logprobs is not None or seq.grammar is not None
            or changes_logits(seq, eos_token_ids))


class SampleStage:
    """Stateless across steps apart from the grammar compiler's caches and the penalty counts."""

    def __init__(self, eos_token_ids: set[int], grammars: GrammarCompiler | None,
                 compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.eos_token_ids = eos_token_ids
        self.eos_list = sorted(eos_token_ids)
        self.grammars = grammars
        self.compute_logits = compute_logits
        self.sampler = Sampler()
        self.penalty_counts = PenaltyCounts()

    def token_picker(self, rows: list[ScheduledSeq]) -> TokenPlan | None:
        """How to take these rows' tokens straight from their logits (`TokenPlan`), or None when
        every row needs the logits themselves (`needs_logits`). `rows` are in the runner's order
        (`engine.model.runner.sampling_rows`)."""
        draws = Draws()  # rows numbered among the picked rows
        logit_rows: list[int] = []
        for i, item in enumerate(rows):
            seq = item.seq
            p = seq.request.params
            if needs_logits(seq, self.eos_list):
                logit_rows.append(i)
            elif not p.is_greedy:
                draws.add(i - len(logit_rows), p, seq.stream, seq.num_output_tokens)
        if len(logit_rows) == len(rows):
            return None
        return TokenPlan(draws, logit_rows)

    def __call__(self, sampling: list[ScheduledSeq], logits: torch.Tensor,
                 prompt_hidden: list[tuple[ScheduledSeq, torch.Tensor]],
                 tokens: torch.Tensor | None = None, logit_rows: list[int] | None = None) -> StepSamples:
        """`tokens`: the tokens of the rows not in `logit_rows`, already taken (see `token_picker`);
        `logits` then holds the `logit_rows` only."""
        out = StepSamples()
        for item, hidden in prompt_hidden:
            k = item.seq.request.params.prompt_logprobs or 0
            out.prompt_logprobs[item.seq.request.request_id] = chunk_prompt_logprobs(
                self.compute_logits, item, hidden, k)
        if tokens is None:
            self._from_logits(sampling, logits, out)
            return out
        needs = set(logit_rows or [])
        if needs:  # first, so that the row indices of out.top_logprobs stay those of _from_logits
            self._from_logits([sampling[i] for i in sorted(needs)], logits, out)
        picked = [item.seq for i, item in enumerate(sampling) if i not in needs]
        out.seqs += picked
        out.token_ids += [[t] for t in tokens.tolist()]
        if out.logprobs is not None:
            out.logprobs += [[0.0]] * len(picked)  # as `_sample` fills rows that asked for none
        return out

    def _from_logits(self, sampling: list[ScheduledSeq], logits: torch.Tensor, out: StepSamples) -> None:
        """Sample every row of `sampling` from `logits` (row i is `sampling[i]`'s)."""
        rows: list[int] = []  # logits row of each sample row
        seqs: list[Sequence] = []
        widths: list[int] = []  # sample rows per sampling sequence (n > 1 forks at its first token)
        beams: dict[str, list[tuple[Sequence, int]]] = {}
        for i, item in enumerate(sampling):
            seq = item.seq
            request = seq.request
            if request.params.use_beam_search:
                beams.setdefault(request.request_id, []).append((seq, i))
                continue
            width = request.params.num_candidates if request.needs_fork else 1
            rows += [i] * width
            seqs.append(seq)
            widths.append(width)
        if seqs:
            self._sample(logits, rows, seqs, widths, out)
        for items in beams.values():
            out.beams.append(beam_step(items[0][0].request, items, logits, self.eos_token_ids))

    def _sample(self, logits: torch.Tensor, rows: list[int], seqs: list[Sequence], widths: list[int],
                out: StepSamples) -> None:
        expanded = len(rows) != logits.shape[0] or rows != list(range(len(rows)))
        if expanded:
            logits = logits.index_select(0, torch.tensor(rows, dtype=torch.long, device=logits.device))
        row_seqs = [seq for seq, w in zip(seqs, widths, strict=True) for _ in range(w)]
        streams = [sample_stream(k) if w > 1 else seq.stream
                   for seq, w in zip(seqs, widths, strict=True) for k in range(w)]
        token_indices = [0 if w > 1 else seq.num_output_tokens for seq, w in zip(seqs, widths, strict=True)
                         for _ in range(w)]
        batch = SamplingBatch([s.request.params for s in row_seqs], streams, token_indices, logits.device)
        logprobs = Logprobs(logits, batch)
        apply_processors(logits, row_seqs, self.eos_list, self.penalty_counts)
        constrained = [i for i, seq in enumerate(row_seqs) if seq.grammar is not None]
        if constrained and self.grammars is not None:
            grammars = [row_seqs[i].grammar for i in constrained]
            self.grammars.apply(logits, constrained, [g for g in grammars if isinstance(g, Grammar)])
        tokens = self.sampler(logits, batch)
        flat = tokens.tolist()
        values, tops = logprobs.gather(tokens)
        flat_logprobs = [0.0] * len(flat)
        for j, row in enumerate(logprobs.rows):
            flat_logprobs[row] = values[j]
        top_of = {row: tops[j] for j, row in enumerate(logprobs.rows)
                  if row_seqs[row].request.params.logprobs is not None}
        out.logprobs = [] if logprobs.rows else None
        offset = 0
        for r, (seq, width) in enumerate(zip(seqs, widths, strict=True)):
            out.seqs.append(seq)
            out.token_ids.append(flat[offset : offset + width])
            if out.logprobs is not None:
                out.logprobs.append(flat_logprobs[offset : offset + width])
            if offset in top_of:
                out.top_logprobs[r] = [top_of[offset + k] for k in range(width)]
            offset += width
