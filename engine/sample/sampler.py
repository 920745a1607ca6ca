"""Turn a batch of logits into tokens: greedy, temperature, top-k, top-p, min-p, seeded.

Every random row draws one uniform number derived only from (seed, sample stream, token index)
and inverts the CDF of its filtered distribution in token-id order. Filters are value
thresholds (ties at the cut are kept), so a row's token depends on nothing but its own
logits and key, never on the other rows, their order, or which code path the batch took.
A preempted or resumed request therefore continues exactly as it would have.

The per-row parameters travel as tensors (`SamplingBatch`); a batch of greedy rows is one
argmax, with no softmax; random rows go to one inverse-CDF kernel that never writes the
probabilities out (`ops.sample_from_logits`, or `ops.sample_filtered` when a row has top-k,
top-p or min-p).

Logprobs (`Logprobs`) are log_softmax of the logits *before* any processor (penalties, bias,
grammar mask, temperature, filters), as the OpenAI API and vLLM report them: the model's own
probability of the token; computed only for rows that ask.
"""

from __future__ import annotations

import bisect
import hashlib
from dataclasses import dataclass

import torch

import ops
from common.sampling_params import SamplingParams


def uniform(seed: int | None, stream: str, token_index: int) -> float:
    """A number in [0, 1) with 23 random bits, exact in fp32 and strictly below 1 after scaling."""
    text = f"{seed}\x1f{stream}\x1f{token_index}".encode()
    bits = int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")
    return (bits >> 41) / float(1 << 23)


@dataclass(frozen=True, slots=True)
class SeedKey:
    """Where a random draw comes from: the request's seed, the sample's stream
    (`engine.sched.sequence.sample_stream`, e.g. "sample/2") and the generated-token index."""

    seed: int | None
    stream: str
    token_index: int

    def uniform(self) -> float:
        return uniform(self.seed, self.stream, self.token_index)


class SamplingBatch:
    """The parameters of a step's sampling rows as tensors; random-row tensors exist only when
    some row is random, and hold those rows only (`random_rows` says which)."""

    def __init__(self, params: list[SamplingParams], streams: list[str], token_indices: list[int],
                 device: torch.device | str = "cpu") -> None:
        self.size = len(params)
        self.random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        self.logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None or p.num_candidates > p.n]
        self.num_logprobs = [params[i].logprobs or 0 for i in self.logprob_rows]
        if self.random_rows:
            chosen = [params[i] for i in self.random_rows]
            self.temperature = torch.tensor([p.temperature for p in chosen], device=device).unsqueeze(1)
            self.top_k = [p.top_k for p in chosen]
            self.top_p = [p.top_p for p in chosen]
            self.min_p = [p.min_p for p in chosen]
            self.uniforms = torch.tensor([uniform(chosen[j].seed, streams[i], token_indices[i])
                                          for j, i in enumerate(self.random_rows)], device=device).unsqueeze(1)
            # positions in random_rows of the rows with no top-k / top-p / min-p filter
            self.unfiltered = [j for j, p in enumerate(chosen) if not is_filtered(p)]


def argmax_tokens(logits: torch.Tensor, first_row: int = 0) -> torch.Tensor:
    """The greedy token of each row: its first maximum."""
    return logits.max(dim=-1).indices  # first maximum on ties (faster than argmax)


class TokenPlan:
    """A step's tokens taken straight from each group of logits rows (`LlamaForCausalLM.pick_tokens`),
    without keeping the logits: the argmax, and for `random_rows` (sorted) the inverse-CDF draw
    that `Sampler` makes for a random row, with the same temperatures, filters and uniforms, so a
    row gets the same token either way. Every other row is greedy. The plan's rows are the step's
    rows minus `logit_rows`, which need their logits and take `SampleStage`'s full path."""

    def __init__(self, random_rows: list[int], temperatures: list[float], uniforms: list[float],
                 filters: tuple[list[int], list[float], list[float]] | None = None,
                 logit_rows: list[int] | None = None) -> None:
        self.random_rows = random_rows
        self.logit_rows = logit_rows or []  # rows of the step that need their logits (not this plan's)
        self.temperatures, self.uniform_values, self.filters = temperatures, uniforms, filters
        self.inv_temperature = 1.0 / torch.tensor(temperatures)  # fp32, as `_draw` computes it
        self.uniforms = torch.tensor(uniforms)
        # (top_k, top_p, min_p) per random row, when some row has a filter
        self.filter_tensors = filter_tensors(*filters) if filters else None

    def only_random(self) -> TokenPlan:
        """The plan of the random rows alone, renumbered from 0 in their order."""
        return TokenPlan(list(range(len(self.random_rows))), self.temperatures, self.uniform_values, self.filters)

    def __call__(self, logits: torch.Tensor, first_row: int) -> torch.Tensor:
        lo = bisect.bisect_left(self.random_rows, first_row)
        hi = bisect.bisect_left(self.random_rows, first_row + logits.shape[0])
        if hi == lo:
            return argmax_tokens(logits)
        if hi - lo == logits.shape[0]:
            return self._draw(logits, lo, hi)
        tokens = argmax_tokens(logits)
        local = torch.tensor([r - first_row for r in self.random_rows[lo:hi]], dtype=torch.long, device=logits.device)
        tokens[local] = self._draw(logits.index_select(0, local), lo, hi)
        return tokens

    def _draw(self, logits: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """Random rows lo..hi of the plan, as `_draw` draws them."""
        device = logits.device
        inv_t, uniforms = self.inv_temperature[lo:hi].to(device), self.uniforms[lo:hi].to(device)
        if self.filter_tensors is None:
            return ops.sample_from_logits(logits, inv_t, uniforms)
        k, p, m = (t[lo:hi].to(device) for t in self.filter_tensors)
        return ops.sample_filtered(logits, inv_t, k, p, m, uniforms)


class Sampler:
    """Stateless; one call per engine step. Returns int64 token ids, one per row."""

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        if logits.dim() != 2 or logits.shape[0] != batch.size:
            raise ValueError(f"logits must be [{batch.size}, vocab], one row per spec; got {list(logits.shape)}")
        if len(batch.random_rows) == batch.size:
            return _draw(logits, batch)
        tokens = argmax_tokens(logits)  # greedy rows
        if batch.random_rows:
            rows = _rows(batch.random_rows, batch.size, logits.device)
            tokens[rows] = _draw(logits[rows], batch)
        return tokens


class Logprobs:
    """Logprobs of a batch's rows that ask, taken from the logits before any processor runs."""

    def __init__(self, logits: torch.Tensor, batch: SamplingBatch) -> None:
        self.rows = batch.logprob_rows
        self.num = batch.num_logprobs
        if not self.rows:
            return
        index = _rows(self.rows, batch.size, logits.device)
        self.raw = logits[index].float().clone() if isinstance(index, torch.Tensor) else logits.float().clone()
        self.lse = torch.logsumexp(self.raw, dim=-1, keepdim=True)
        k = max(self.num)
        self.top_values: torch.Tensor | None = None
        self.top_ids: torch.Tensor | None = None
        if k:
            self.top_values, self.top_ids = torch.topk(self.raw, k, dim=-1)

    def gather(self, tokens: torch.Tensor) -> tuple[list[float], list[list[tuple[int, float]]]]:
        """Per logprob row: the chosen token's logprob and its top alternatives."""
        if not self.rows:
            return [], []
        chosen = tokens[_rows(self.rows, tokens.shape[0], tokens.device)].unsqueeze(1)
        values = (self.raw.gather(1, chosen) - self.lse).squeeze(1).tolist()
        tops: list[list[tuple[int, float]]] = [[] for _ in self.rows]
        if self.top_values is not None and self.top_ids is not None:
            top_values = (self.top_values - self.lse).tolist()
            top_ids = self.top_ids.tolist()
            for j, n in enumerate(self.num):
                tops[j] = list(zip(top_ids[j][:n], top_values[j][:n], strict=True))
        return values, tops


def is_filtered(p: SamplingParams) -> bool:
    """True when a random row's distribution is cut by top-k, top-p or min-p."""
    return p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0


def _draw(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Tokens for the random rows (`logits` holds those rows only), by one inverse-CDF kernel:
    `ops.sample_filtered` when some row has top-k/top-p/min-p, else `ops.sample_from_logits`
    (the same draw for a row without filters, so a row's token never depends on its batch-mates)."""
    inv_t = 1.0 / batch.temperature.squeeze(1)
    uniforms = batch.uniforms.squeeze(1)
    if len(batch.unfiltered) == len(batch.top_k):
        return ops.sample_from_logits(logits, inv_t, uniforms)
    return ops.sample_filtered(logits, inv_t, *filter_tensors(batch.top_k, batch.top_p, batch.min_p, logits.device),
                               uniforms)


def filter_tensors(top_k: list[int], top_p: list[float], min_p: list[float],
                   device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The per-row filters as `ops.sample_filtered` takes them."""
    return (torch.tensor(top_k, dtype=torch.int64, device=device), torch.tensor(top_p, device=device),
            torch.tensor(min_p, device=device))


def _rows(rows: list[int], batch: int, device: torch.device) -> torch.Tensor | slice:
    """Index for a subset of rows; a plain slice (no copy) when it is the whole batch."""
    if len(rows) == batch:
        return slice(None)
    return torch.tensor(rows, dtype=torch.long, device=device)

