"""One step's sampling: the model's output for the step's plan → `StepSamples`, changing no
sequence and no request (the scheduler's `update_from_output` applies them, beam searches too).

Every token of the step is chosen here, from the model's head (`engine.sample.head`): the rows
the plan's picker takes (greedy, or random without processors) come as tokens straight from the
head, group by group as it makes their logits (or through its greedy screen); the other rows get
their logits. Each logits row samples as many rows as its plan width (a request of n > 1 at its
first token: the row repeated, keyed by each candidate's stream) or goes to its request's beam
search. Then: logprobs of the raw rows that ask → penalties, bias, min_tokens → grammar masks →
sampler, each in bulk; one `tolist()` per result tensor. The speculative rows' positions are
verified last (`engine.sample.verify`)."""

from __future__ import annotations

import time

import torch

from engine.sample.beam_step import beam_step
from engine.sample.grammar import Grammar, GrammarCompiler
from engine.sample.head import choose_tokens
from engine.sample.penalty_counts import PenaltyCounts
from engine.sample.processors import apply_processors
from engine.sample.prompt_logprobs import chunk_prompt_logprobs
from engine.sample.sampler import Logprobs, Sampler, SamplingBatch
from engine.sample.step_plan import BEAM, ModelOutput, StepPlan
from engine.sample.verify import verify
from engine.sched.output import StepSamples
from engine.sched.sequence import Sequence, sample_stream
from ops.policy import FASTEST, OpsPolicy


class SampleStage:
    """Stateless across steps apart from the grammar compiler's caches and the penalty counts."""

    def __init__(self, eos_token_ids: set[int], grammars: GrammarCompiler | None,
                 policy: OpsPolicy = FASTEST) -> None:
        self.eos_token_ids = eos_token_ids
        self.eos_list = sorted(eos_token_ids)
        self.grammars = grammars
        self.sampler = Sampler(policy)
        self.penalty_counts = PenaltyCounts()
        self.head_seconds = 0.0  # cumulative time in the head's logits and tokens of the sampling rows

    def __call__(self, plan: StepPlan, result: ModelOutput) -> StepSamples:
        """The samples of the plan's sampling rows and prompt-logprob chunks, and its verified
        speculative rows: the logits rows first, then the picked rows."""
        start = time.perf_counter()
        logits, tokens = _sampling_rows(plan, result)
        spec_tokens, spec_logits = _spec_rows(plan, result)
        hidden = result.sample_hidden if result.sample_hidden is not None else result.spec_hidden
        if hidden is not None and hidden.is_cuda:  # the forward's kernels and the head's end here: one wait a step
            torch.cuda.synchronize(hidden.device)
        self.head_seconds += time.perf_counter() - start
        out = StepSamples()
        for item, rows in result.prompt_hidden:
            k = item.seq.request.params.prompt_logprobs or 0
            out.prompt_logprobs[item.seq.request.request_id] = chunk_prompt_logprobs(
                result.head.logits, item, rows, k)
        if plan.logit_rows:  # first, so that the row indices of out.top_logprobs are the logits rows'
            self._from_logits(plan, logits, out)
        if tokens is not None:
            picked = [plan.sampling[i].seq for i in plan.picked_rows]
            out.seqs += picked
            out.token_ids += [[t] for t in tokens.tolist()]
            if out.logprobs is not None:
                out.logprobs += [[0.0]] * len(picked)  # as `_sample` fills rows that asked for none
        if spec_tokens is not None:
            out.spec = verify(plan, spec_tokens, spec_logits, self.sampler, self.eos_list, self.grammars)
        return out

    def _from_logits(self, plan: StepPlan, logits: torch.Tensor, out: StepSamples) -> None:
        """Sample every logits row of the plan (`logits` row j is `plan.logit_rows[j]`'s)."""
        rows: list[int] = []  # logits row of each sample row
        seqs: list[Sequence] = []
        widths: list[int] = []  # sample rows per sampling sequence (n > 1 forks at its first token)
        beams: dict[str, list[tuple[Sequence, int]]] = {}
        for j, (i, width) in enumerate(zip(plan.logit_rows, plan.widths, strict=True)):
            seq = plan.sampling[i].seq
            if width is BEAM:
                beams.setdefault(seq.request.request_id, []).append((seq, j))
                continue
            rows += [j] * width
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


def _sampling_rows(plan: StepPlan, result: ModelOutput) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The fp32 logits of the plan's `logit_rows` of the sampling rows, and the picker's tokens of
    the others (None without a picker)."""
    rows, head = result.sample_hidden, result.head
    if rows is None:
        return torch.empty((0, 0), dtype=torch.float32), None
    if plan.picker is None:
        return head.logits(rows), None
    if not plan.logit_rows:
        return rows.new_empty((0, 0), dtype=torch.float32), choose_tokens(head, rows, plan.picker)
    keep = torch.tensor(plan.logit_rows, dtype=torch.long, device=rows.device)
    picked = torch.ones(rows.shape[0], dtype=torch.bool, device=rows.device)
    picked[keep] = False
    return head.logits(rows.index_select(0, keep)), choose_tokens(head, rows[picked], plan.picker)


def _spec_rows(plan: StepPlan, result: ModelOutput) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    """The token of every speculative position by the plan's `spec_picker`, and the fp32 logits of
    each `spec_logit_ranges` range (one head call per range: a sequence's 1 + k positions, as many
    rows as plain decoding gives the lm_head); None and [] without speculative rows."""
    hidden, head = result.spec_hidden, result.head
    if hidden is None:
        return None, []
    tokens = choose_tokens(head, hidden, plan.spec_picker)
    return tokens, [head.logits(hidden[lo:hi]) for lo, hi in plan.spec_logit_ranges.values()]
