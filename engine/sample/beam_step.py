"""Beam search on paged sequences: one sequence per running beam. Each step the search picks
(parent, token) pairs; a parent chosen more than once is forked (its blocks shared
copy-on-write), a parent nobody chose is freed."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.outputs import CompletionOutput
from engine.sample.beam_search import BeamSearchState
from engine.sched.sequence import Request, Sequence

if TYPE_CHECKING:
    from engine.sample.output_processor import OutputProcessor


def beam_step(request: Request, items: list[tuple[Sequence, int]], logits: torch.Tensor,
              processor: OutputProcessor) -> None:
    """Advance one request's beams by one token, given its logits rows."""
    params = request.params
    if request.beam is None:
        eos = [] if params.ignore_eos else sorted(processor.eos_token_ids | set(params.stop_token_ids))
        request.beam = BeamSearchState(params.num_candidates, params.length_penalty, params.early_stopping,
                                       eos, params.max_tokens, params.min_tokens)
    order = {seq.seq_id: row for seq, row in items}
    beams = request.unfinished_seqs()
    rows = torch.tensor([order[seq.seq_id] for seq in beams], device=logits.device)
    chosen = request.beam.step(torch.log_softmax(logits.index_select(0, rows), dim=-1))
    if request.first_token_time is None:
        import time

        request.first_token_time = time.monotonic()
    used: set[int] = set()
    next_beams: list[tuple[Sequence, int]] = []
    for index, (parent_row, token) in enumerate(chosen):
        parent = beams[parent_row]
        if parent_row in used:
            child = parent.fork(index)
            processor.scheduler.block_manager.fork(parent.seq_id, child.seq_id)
            next_beams.append((child, token))
        else:
            used.add(parent_row)
            next_beams.append((parent, token))
    for row, seq in enumerate(beams):
        if row not in used:
            processor.finish_seq(seq, "beam")
    for index, (seq, token) in enumerate(next_beams):
        seq.index = index
        seq.token_ids.append(token)
    request.seqs = [seq for seq, _ in next_beams] + [s for s in request.seqs if s.is_finished]
    if request.beam.is_done:
        for seq, _ in next_beams:
            processor.finish_seq(seq, "beam")


def beam_outputs(request: Request, eos_token_ids: set[int]) -> list[CompletionOutput]:
    """The n best hypotheses as completions, best first."""
    assert request.beam is not None
    out = []
    for index, (tokens, score) in enumerate(request.beam.best(request.params.n)):
        reason = "stop" if tokens and tokens[-1] in eos_token_ids else "length"
        out.append(CompletionOutput(index, list(tokens), reason, None, float(score)))
    return out
