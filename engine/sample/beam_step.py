"""Beam search on paged sequences: one sequence per running beam. Each step the search
(`BeamSearchState`, kept on the request) picks (parent, token) pairs; the scheduler then forks
a parent chosen more than once and frees a parent nobody chose (`BeamChoice`)."""

from __future__ import annotations

import torch

from engine.sample.beam_search import BeamSearchState
from engine.sched.output import BeamChoice
from engine.sched.sequence import Request, Sequence


def beam_step(request: Request, items: list[tuple[Sequence, int]], logits: torch.Tensor,
              eos_token_ids: set[int]) -> BeamChoice:
    """Advance the search of one request by one token, given its beams' logits rows."""
    params = request.params
    search = request.beam
    if search is None:
        eos = [] if params.ignore_eos else sorted(eos_token_ids | set(params.stop_token_ids))
        search = BeamSearchState(params.num_candidates, params.length_penalty, params.early_stopping,
                                 eos, params.max_tokens, params.min_tokens)
        request.beam = search
    elif not isinstance(search, BeamSearchState):
        raise TypeError(f"request {request.request_id} carries a beam search this stage did not make")
    order = {seq.seq_id: row for seq, row in items}
    beams = request.unfinished_seqs()
    rows = torch.tensor([order[seq.seq_id] for seq in beams], device=logits.device)
    chosen = search.step(torch.log_softmax(logits.index_select(0, rows), dim=-1))
    if not chosen:  # the search ended without new beams this step
        return BeamChoice(request, [], True)
    return BeamChoice(request, [(beams[parent], token) for parent, token in chosen], search.is_done)
