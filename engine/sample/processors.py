"""Logits processors, in place on a step's sampling rows, each in bulk over the rows it concerns:

1. penalties: repetition (HF/vLLM: a seen token's positive logit is divided by the penalty, a
   negative one multiplied; "seen" = in the prompt or the output), frequency and presence
   (OpenAI: minus `frequency * count + presence * (count > 0)` over the output tokens);
2. `logit_bias` (added to the logit, OpenAI's -100..100);
3. below `min_tokens`, EOS and the stop token ids cannot be drawn (not for a row under a
   grammar: it ends when its grammar is complete).

Penalty counts are kept per sequence across steps (`penalty_counts.PenaltyCounts`). Each
depends only on the row's own request and tokens, so the per-token seeding still makes a
row's draw independent of its batch. The grammar mask (`grammar.py`) runs after these."""

from __future__ import annotations

import torch

from common.sampling_params import SamplingParams
from engine.sample.penalty_counts import PenaltyCounts
from engine.sched.sequence import Sequence


def apply_processors(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: list[int],
                     counts: PenaltyCounts | None = None) -> None:
    """`logits[i]` belongs to `seqs[i]` (its next token). `counts`: the engine's incremental
    token counts (a throwaway one, counting from scratch, when None)."""
    params = [seq.request.params for seq in seqs]
    penalized = [i for i, p in enumerate(params) if _has_penalty(p)]
    if penalized:
        _penalize(logits, penalized, [seqs[i] for i in penalized], counts if counts is not None else PenaltyCounts())
    biased = [i for i, p in enumerate(params) if p.logit_bias]
    if biased:
        rows = [i for i in biased for _ in params[i].logit_bias]
        cols = [t for i in biased for t in params[i].logit_bias]
        values = [float(v) for i in biased for v in params[i].logit_bias.values()]
        logits.index_put_((_long(rows, logits), _long(cols, logits)), torch.tensor(values, device=logits.device),
                          accumulate=True)
    rows, cols = [], []
    for i, seq in enumerate(seqs):
        banned = _banned(seq, eos_token_ids)
        rows += [i] * len(banned)
        cols += banned
    if rows:
        logits.index_put_((_long(rows, logits), _long(cols, logits)), torch.tensor(float("-inf")))


def changes_logits(seq: Sequence, eos_token_ids: list[int]) -> bool:
    """True when some processor would change this sequence's logits row now."""
    p = seq.request.params
    return _has_penalty(p) or bool(p.logit_bias) or bool(_banned(seq, eos_token_ids))


def _banned(seq: Sequence, eos_token_ids: list[int]) -> list[int]:
    """Token ids this row cannot draw now: below `min_tokens`, EOS and the stop token ids."""
    p = seq.request.params
    if p.min_tokens and seq.grammar is None and len(seq.token_ids) - seq.num_prompt_tokens < p.min_tokens:
        return p.stop_token_ids + ([] if p.ignore_eos else eos_token_ids)
    return []


def _has_penalty(p: SamplingParams) -> bool:
    return p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0


def _penalize(logits: torch.Tensor, rows: list[int], seqs: list[Sequence], store: PenaltyCounts) -> None:
    vocab, device = logits.shape[1], logits.device
    index = _long(rows, logits)
    sub = logits.index_select(0, index)
    params = [seq.request.params for seq in seqs]
    repetition = torch.tensor([p.repetition_penalty for p in params], device=device).unsqueeze(1)
    use_repetition = any(p.repetition_penalty != 1.0 for p in params)
    counts, in_prompt = store.gather(seqs, vocab, device, use_repetition)
    if in_prompt is not None:
        seen = (counts > 0) | in_prompt
        penalized = torch.where(sub > 0, sub / repetition, sub * repetition)
        sub = torch.where(seen, penalized, sub)
    frequency = torch.tensor([p.frequency_penalty for p in params], device=device).unsqueeze(1)
    presence = torch.tensor([p.presence_penalty for p in params], device=device).unsqueeze(1)
    sub = sub - frequency * counts - presence * (counts > 0).to(sub.dtype)
    logits.index_copy_(0, index, sub)


def count_tokens(token_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[rows, vocab] occurrence counts from scratch (the reference `PenaltyCounts` must equal)."""
    width = max((len(t) for t in token_lists), default=0)
    padded = torch.full((len(token_lists), max(width, 1)), vocab, dtype=torch.long)
    for i, tokens in enumerate(token_lists):
        if tokens:
            padded[i, : len(tokens)] = torch.tensor(tokens)
    counts = torch.zeros((len(token_lists), vocab + 1), dtype=torch.float32)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
    return counts[:, :vocab].to(device)


def _long(values: list[int], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=like.device)
