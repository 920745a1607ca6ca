"""Prompt logprobs: the log-softmax, at every prompt position, of the prompt's next token (and
the k most likely alternatives), from the hidden states the runner kept for a chunk. The first
prompt token has no predecessor: its entry is None. Rows go through the lm_head in slices, so
a long prompt never holds a [prompt, vocab] matrix at once."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from engine.sched.output import ScheduledSeq

SLICE_ROWS = 256


def chunk_prompt_logprobs(compute_logits: Callable[[torch.Tensor], torch.Tensor], item: ScheduledSeq,
                          hidden: torch.Tensor, k: int) -> tuple[int, list[dict[str, Any] | None]]:
    """(chunk start, entries for prompt tokens start+1 ..., led by None when start is 0)."""
    targets = item.seq.token_ids[item.start + 1 : item.start + 1 + item.num_prompt_logits]
    entries: list[dict[str, Any] | None] = [None] if item.start == 0 else []
    for lo in range(0, len(targets), SLICE_ROWS):
        part = targets[lo : lo + SLICE_ROWS]
        logp = torch.log_softmax(compute_logits(hidden[lo : lo + len(part)]).float(), dim=-1)
        index = torch.tensor(part, dtype=torch.long, device=logp.device).unsqueeze(1)
        chosen = logp.gather(1, index).squeeze(1).tolist()
        tops: list[list[tuple[int, float]]] = [[] for _ in part]
        if k:
            values, ids = torch.topk(logp, k, dim=-1)
            tops = [list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
        entries += [{"token_id": t, "logprob": lp, "top_logprobs": top}
                    for t, lp, top in zip(part, chosen, tops, strict=True)]
    return item.start, entries
