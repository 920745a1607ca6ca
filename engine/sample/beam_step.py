"""Beam search on paged sequences: one sequence per running beam. Each step the search
(`BeamSearchState`, kept on the request) picks (parent, token) pairs; the scheduler then forks
a parent chosen more than once, frees a parent nobody chose and keeps the search's new state
(`BeamChoice`). The request's own search is never changed here: a copy steps."""

from __future__ import annotations

import torch

from engine.sample.beam_search import BeamSearchState
from engine.sched.output import BeamChoice
from engine.sched.sequence import Request, Sequence


def beam_step(request: Request, items: list[tuple[Sequence, int]], logits: torch.Tensor,
              eos_token_ids: set[int]) -> BeamChoice:
    """The search of one request advanced by one token, given its beams' logits rows."""
    params = request.params
    if request.beam is None:
        eos = [] if params.ignore_eos else sorted(eos_token_ids | set(params.stop_token_ids))
        search = BeamSearchState(params.num_candidates, params.length_penalty, params.early_stopping,
                                 eos, params.max_tokens, params.min_tokens)
    elif isinstance(request.beam, BeamSearchState):
        search = request.beam.copy()
    else:
        raise TypeError(f"request {request.request_id} carries a beam search this stage did not make")
    order = {seq.seq_id: row for seq, row in items}
    beams = request.unfinished_seqs()
    rows = torch.tensor([order[seq.seq_id] for seq in beams], device=logits.device)
    chosen = search.step(torch.log_softmax(logits.index_select(0, rows), dim=-1))
    if not chosen:  # the search ended without new beams this step
        return BeamChoice(request=request, chosen=[], done=True, search=search)
    return BeamChoice(request=request, chosen=[(beams[parent], token) for parent, token in chosen],
                      done=search.is_done, search=search)
