"""One request's beam search, step by step, with Hugging Face transformers' (v5) rules.

Per step, over every running beam x vocab: keep the top (1 + #eos, at least 2) x width
candidates by cumulative log-prob. Candidates ranked below `width` that end in EOS (or reach
`max_tokens`) become finished hypotheses scored cum_logprob / num_generated ** length_penalty
(num_generated counts the new token, never the prompt); the best `width` unfinished ones run
on. The score arithmetic is done in fp32 torch ops in HF's order, so ties and rounding match.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch

EarlyStopping = bool | str  # False, True or "never"
_NEG = -1.0e9  # HF's "impossible" score


class BeamSearchState:
    """Beam search for one request. The engine keeps one sequence per running beam.

    Call `step` with the next-token log-probs of the running beams (one row per beam, in the
    order the previous `step` returned them; one row, the prompt, at first). It returns the
    new running beams as (parent row, token id): fork the parent's blocks for each, free the
    parents nobody chose. An empty list means the search is over; read `best(n)`."""

    def __init__(
        self,
        beam_width: int,
        length_penalty: float = 1.0,
        early_stopping: EarlyStopping = False,
        eos_token_ids: Sequence[int] = (),
        max_tokens: int = 16,
        min_tokens: int = 0,
    ) -> None:
        if beam_width < 1 or max_tokens < 1:
            raise ValueError(f"beam_width and max_tokens must be >= 1, got {beam_width}, {max_tokens}")
        self.beam_width = beam_width
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self.max_tokens = max_tokens
        self.min_tokens = min_tokens
        self.num_generated = 0
        self._eos = torch.tensor(sorted(set(eos_token_ids)), dtype=torch.long)
        self._num_candidates = max(2, 1 + len(self._eos)) * beam_width
        self._running: list[list[int]] = [[]]
        self._running_scores = torch.zeros(1)
        self._finished: list[list[int]] = [[] for _ in range(beam_width)]
        self._finished_scores = torch.full((beam_width,), _NEG)
        self._is_finished = torch.zeros(beam_width, dtype=torch.bool)
        self._improvable = True
        self._done = False

    @property
    def is_done(self) -> bool:
        return self._done

    @property
    def num_running(self) -> int:
        return 0 if self._done else len(self._running)

    def copy(self) -> BeamSearchState:
        """An independent copy in the same state: `step` rebinds every attribute it changes (new
        lists, new tensors) and never writes into one, so a shallow copy steps on its own."""
        return copy.copy(self)

    def step(self, beam_logprobs: torch.Tensor) -> list[tuple[int, int]]:
        """Advance one token. `beam_logprobs` is [num_running, vocab] log_softmax output."""
        if self._done:
            raise RuntimeError("beam search is already done")
        if beam_logprobs.dim() != 2 or beam_logprobs.shape[0] != len(self._running):
            shape = list(beam_logprobs.shape)
            raise ValueError(f"expected [{len(self._running)}, vocab] log-probs (one row per beam), got {shape}")
        logprobs = beam_logprobs.detach().to("cpu", torch.float32)
        if self.num_generated < self.min_tokens and len(self._eos):
            logprobs = logprobs.index_fill(1, self._eos, float("-inf"))
        vocab = logprobs.shape[1]
        total = (logprobs + self._running_scores[:, None]).reshape(-1)
        scores, flat = torch.topk(total, min(self._num_candidates, total.numel()))
        parents, tokens = flat // vocab, flat % vocab
        ends = torch.isin(tokens, self._eos) | (self.num_generated + 1 >= self.max_tokens)
        candidates = [self._running[p] + [t] for p, t in zip(parents.tolist(), tokens.tolist(), strict=True)]
        self._add_finished(candidates, scores, ends)
        chosen = self._keep_running(candidates, scores, ends, parents, tokens)
        self.num_generated += 1
        self._update_done(ends)
        return [] if self._done else chosen

    def best(self, n: int = 1) -> list[tuple[list[int], float]]:
        """The n best hypotheses (token ids, EOS included; score), best first. Before the search
        is done, running beams (scored like finished ones) fill in for missing finished ones."""
        pool = [(t, s) for t, s, f in zip(self._finished, self._finished_scores.tolist(),
                                          self._is_finished.tolist(), strict=True) if f]
        if len(pool) < n and not self._done and self.num_generated:
            norm = self.num_generated**self.length_penalty
            pool += [(t, s / norm) for t, s in zip(self._running, self._running_scores.tolist(), strict=True)]
        return sorted(pool, key=lambda item: -item[1])[:n]

    def _add_finished(self, candidates: list[list[int]], scores: torch.Tensor, ends: torch.Tensor) -> None:
        ranked = torch.arange(len(candidates)) < self.beam_width
        just_finished = ends & ranked
        new = scores / ((self.num_generated + 1) ** self.length_penalty)
        if self.early_stopping is True and bool(self._is_finished.all()):
            new = new + _NEG
        if not self._improvable:
            new = new + _NEG
        new = new + (~just_finished) * _NEG
        merged = torch.cat((self._finished_scores, new))
        flags = torch.cat((self._is_finished, just_finished))
        keep = torch.topk(merged, self.beam_width).indices
        pool = self._finished + candidates
        self._finished = [pool[i] for i in keep.tolist()]
        self._finished_scores, self._is_finished = merged[keep], flags[keep]

    def _keep_running(
        self, candidates: list[list[int]], scores: torch.Tensor, ends: torch.Tensor,
        parents: torch.Tensor, tokens: torch.Tensor,
    ) -> list[tuple[int, int]]:
        running = scores + ends.to(torch.float32) * _NEG
        keep = torch.topk(running, min(self.beam_width, len(candidates))).indices
        self._running = [candidates[i] for i in keep.tolist()]
        self._running_scores = running[keep]
        return list(zip(parents[keep].tolist(), tokens[keep].tolist(), strict=True))

    def _update_done(self, ends: torch.Tensor) -> None:
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_length = self.max_tokens
        else:
            best_length = self.num_generated
        best_running = self._running_scores[:1] / (best_length**self.length_penalty)
        worst = torch.where(self._is_finished, self._finished_scores.min(), _NEG)
        self._improvable = self._improvable and bool((best_running > worst).any())
        all_full = bool(self._is_finished.all()) and self.early_stopping is True
        self._done = not self._improvable or all_full or bool(ends.all())
