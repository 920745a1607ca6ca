"""Turn a batch of logits into tokens: greedy, temperature, top-k, top-p, min-p, seeded.

Every random row draws one uniform number derived only from (seed, sample stream, token index)
and inverts the CDF of its filtered distribution in token-id order. Filters are value
thresholds (ties at the cut are kept), so a row's token depends on nothing but its own
logits and key, never on the other rows, their order, or which code path the batch took.
A preempted or resumed request therefore continues exactly as it would have.

The per-row parameters travel as tensors (`SamplingBatch`); a batch of greedy rows is one
argmax, with no softmax; random rows without top-k/top-p/min-p go to one inverse-CDF kernel
(`ops.sample_from_logits`) that never writes the probabilities out.

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
from engine.sampling_params import SamplingParams

TOP_P_PROBE = 1024  # top-p first looks at this many most likely tokens, sorts the full row if short


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
    for steps that keep no logits: the argmax, and for `random_rows` (sorted) the inverse-CDF draw
    that `Sampler` makes for an unfiltered random row, with the same temperatures and uniforms,
    so a row gets the same token either way. Every other row is greedy."""

    def __init__(self, random_rows: list[int], temperatures: list[float], uniforms: list[float]) -> None:
        self.random_rows = random_rows
        self.temperatures, self.uniform_values = temperatures, uniforms
        self.inv_temperature = 1.0 / torch.tensor(temperatures)  # fp32, as `_draw` computes it
        self.uniforms = torch.tensor(uniforms)

    def only_random(self) -> TokenPlan:
        """The plan of the random rows alone, renumbered from 0 in their order."""
        return TokenPlan(list(range(len(self.random_rows))), self.temperatures, self.uniform_values)

    def __call__(self, logits: torch.Tensor, first_row: int) -> torch.Tensor:
        lo = bisect.bisect_left(self.random_rows, first_row)
        hi = bisect.bisect_left(self.random_rows, first_row + logits.shape[0])
        if hi == lo:
            return argmax_tokens(logits)
        inv_t, uniforms = self.inv_temperature[lo:hi].to(logits.device), self.uniforms[lo:hi].to(logits.device)
        if hi - lo == logits.shape[0]:
            return ops.sample_from_logits(logits, inv_t, uniforms)
        tokens = argmax_tokens(logits)
        local = torch.tensor([r - first_row for r in self.random_rows[lo:hi]], dtype=torch.long, device=logits.device)
        tokens[local] = ops.sample_from_logits(logits.index_select(0, local), inv_t, uniforms)
        return tokens


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
    """Tokens for the random rows (`logits` holds those rows only): unfiltered rows by the inverse-CDF
    kernel (`ops.sample_from_logits`), filtered ones by the torch path below. Which path a row takes
    depends on its own parameters only, so a row's token never depends on its batch-mates."""
    plain = batch.unfiltered
    if len(plain) == len(batch.top_k):
        return ops.sample_from_logits(logits, 1.0 / batch.temperature.squeeze(1), batch.uniforms.squeeze(1))
    tokens = torch.empty(len(batch.top_k), dtype=torch.int64, device=logits.device)
    if plain:
        index = torch.tensor(plain, dtype=torch.long, device=logits.device)
        tokens[index] = ops.sample_from_logits(logits.index_select(0, index),
                                               1.0 / batch.temperature.squeeze(1)[index],
                                               batch.uniforms.squeeze(1)[index])
    unfiltered = set(plain)
    filtered = [j for j in range(len(batch.top_k)) if j not in unfiltered]
    index = torch.tensor(filtered, dtype=torch.long, device=logits.device)
    tokens[index] = _draw_filtered(logits.index_select(0, index), batch.temperature[index],
                                   [batch.top_k[j] for j in filtered], [batch.top_p[j] for j in filtered],
                                   [batch.min_p[j] for j in filtered], batch.uniforms[index])
    return tokens


def _draw_filtered(logits: torch.Tensor, temperature: torch.Tensor, top_k: list[int], top_p: list[float],
                   min_p: list[float], uniforms: torch.Tensor) -> torch.Tensor:
    vocab = logits.shape[-1]
    scaled = logits / temperature
    ks = [k if 0 < k < vocab else vocab for k in top_k]
    if min(ks) < vocab:
        _mask_top_k(scaled, torch.tensor(ks, device=logits.device))
    probs = torch.softmax(scaled, dim=-1)
    cut = [i for i, p in enumerate(top_p) if p < 1.0]
    if cut:
        rows = _rows(cut, len(top_p), logits.device)
        probs[rows] = _mask_top_p(probs[rows], [top_p[i] for i in cut])
    if any(m > 0 for m in min_p):
        min_ps = torch.tensor(min_p, device=logits.device).unsqueeze(1)
        probs.masked_fill_(probs < min_ps * probs.amax(dim=-1, keepdim=True), 0.0)
    cdf = probs.cumsum(dim=-1)
    picked = torch.searchsorted(cdf, uniforms * cdf[:, -1:], right=True)
    return picked.squeeze(1).clamp_max(vocab - 1)


def _mask_top_k(scaled: torch.Tensor, ks: torch.Tensor) -> None:
    """In place: keep every token whose value reaches the row's k-th largest (ties at the cut kept)."""
    top = torch.topk(scaled, int(ks.max()), dim=-1).values
    kth = top.gather(1, (ks - 1).unsqueeze(1))
    scaled.masked_fill_(scaled < kth, float("-inf"))


def _mask_top_p(probs: torch.Tensor, top_ps: list[float]) -> torch.Tensor:
    """Keep the most likely tokens until their mass reaches top_p (ties at the cut kept).

    The cut only needs the sorted values' prefix, so look at the TOP_P_PROBE largest first and
    sort the whole row only where that prefix falls short of top_p."""
    ps = torch.tensor(top_ps, device=probs.device).unsqueeze(1)
    probe = min(TOP_P_PROBE, probs.shape[-1])
    head = torch.topk(probs, probe, dim=-1).values
    cut = _cut_value(head, ps)
    short = (head.cumsum(dim=-1)[:, -1:] < ps).squeeze(1).nonzero().squeeze(1)
    if short.numel() and probe < probs.shape[-1]:
        full = torch.sort(probs[short], dim=-1, descending=True).values
        cut[short] = _cut_value(full, ps[short])
    return probs.masked_fill_(probs < cut, 0.0)


def _cut_value(sorted_desc: torch.Tensor, ps: torch.Tensor) -> torch.Tensor:
    """Smallest kept probability: the value where the running mass first reaches p."""
    position = (sorted_desc.cumsum(dim=-1) < ps).sum(dim=-1, keepdim=True)
    return sorted_desc.gather(1, position.clamp_max(sorted_desc.shape[-1] - 1))


def _rows(rows: list[int], batch: int, device: torch.device) -> torch.Tensor | slice:
    """Index for a subset of rows; a plain slice (no copy) when it is the whole batch."""
    if len(rows) == batch:
        return slice(None)
    return torch.tensor(rows, dtype=torch.long, device=device)

