"""Turn a batch of logits into tokens: greedy, temperature, top-k, top-p, min-p, typical-p, seeded.

Every random row draws one uniform number derived only from (seed, sample stream, token index)
and inverts the CDF of its filtered distribution in token-id order. Filters are value
thresholds (ties at the cut are kept), so a row's token depends on nothing but its own
logits and key, never on the other rows, their order, or which code path the batch took.
A preempted or resumed request therefore continues exactly as it would have.

The per-row parameters travel as tensors (`SamplingBatch`); a batch of greedy rows is one
argmax, with no softmax; random rows go to one inverse-CDF kernel that never writes the
probabilities out (`ops.sample_from_logits`, or `ops.sample_filtered` when a row has top-k,
top-p, min-p or typical-p). The random rows' parameters are gathered in one place (`Draws`) and
drawn by one function (`draw`), whoever asks: this sampler, and the `TokenPlan`s of the step's
plan (`engine.sample.step_plan`) for the picked rows and the speculative positions, which take
their tokens straight from the model's head (`engine.sample.head`).

Logprobs (`Logprobs`) are log_softmax of the logits *before* any processor (penalties, bias,
grammar mask, temperature, filters), as the OpenAI API and vLLM report them: the model's own
probability of the token; computed only for rows that ask.
"""

from __future__ import annotations

import bisect
import hashlib
import operator
from dataclasses import dataclass
from typing import Any

import torch

import ops
from common.sampling_params import SamplingParams
from ops.policy import FASTEST, OpsPolicy


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


class Draws:
    """The random rows of a batch, gathered the one way every caller takes them (the sampler's
    batch, the step plan's pickers, `engine.sample.step_plan`): per row its temperature,
    its uniform keyed by (seed, stream, token index) and, when some row is filtered, the filters
    (`FILTERS`) in the order `ops.sample_filtered` takes them. `rows` says which rows they are."""

    def __init__(self) -> None:
        self.rows: list[int] = []
        self.temperatures: list[float] = []
        self.uniforms: list[float] = []
        self.filters: list[tuple[Any, ...]] = []  # per row, FILTERS' values
        self.filtered = False

    def add(self, row: int, params: SamplingParams, stream: str, token_index: int) -> None:
        """Row `row` of `params`: drawn at random unless they are greedy (its argmax: nothing to add)."""
        if params.is_greedy:
            return
        self.rows.append(row)
        self.temperatures.append(params.temperature)
        self.uniforms.append(uniform(params.seed, stream, token_index))
        self.filters.append(_filter_values(params))
        self.filtered = self.filtered or is_filtered(params)

    @classmethod
    def unfiltered(cls, rows: list[int], temperatures: list[float], uniforms: list[float]) -> Draws:
        """Draws given outright (tests of `engine.sample.head`): rows, temperatures, uniforms, no filter."""
        out = cls()
        out.rows, out.temperatures, out.uniforms = rows, temperatures, uniforms
        out.filters = [_filter_values(SamplingParams())] * len(rows)  # every filter at its default: off
        return out

    def renumbered(self) -> Draws:
        """The same draws as rows 0, 1, ... in their order."""
        out = Draws()
        out.rows = list(range(len(self.rows)))
        out.temperatures, out.uniforms, out.filters, out.filtered = (self.temperatures, self.uniforms, self.filters,
                                                                     self.filtered)
        return out

    def tensors(self) -> DrawTensors:
        """On the CPU; `DrawTensors.to` moves a slice of them."""
        return DrawTensors(1.0 / torch.tensor(self.temperatures, dtype=torch.float32),
                           torch.tensor(self.uniforms, dtype=torch.float32),
                           filter_tensors(tuple(map(list, zip(*self.filters, strict=True)))) if self.filtered
                           else None)


@dataclass(frozen=True, slots=True)
class DrawTensors:
    """`Draws` as `draw` takes them: fp32 inverse temperatures and uniforms, and the filters or None."""

    inv_temperature: torch.Tensor
    uniforms: torch.Tensor
    filters: tuple[torch.Tensor, ...] | None

    def slice(self, lo: int, hi: int, device: torch.device | str) -> DrawTensors:
        filters = None if self.filters is None else tuple(t[lo:hi].to(device) for t in self.filters)
        return DrawTensors(self.inv_temperature[lo:hi].to(device), self.uniforms[lo:hi].to(device), filters)


def draw(logits: torch.Tensor, draws: DrawTensors, policy: OpsPolicy = FASTEST) -> torch.Tensor:
    """The inverse-CDF token of each row of `logits` (the random rows only, `draws`' device): one
    kernel, `ops.sample_filtered` when some row has a filter, else `ops.sample_from_logits` (the
    same draw for a row without filters, so a row's token never depends on its batch-mates);
    `policy`: the engine's kernels or the reference."""
    if draws.filters is None:
        return ops.sample_from_logits(logits, draws.inv_temperature, draws.uniforms, policy=policy)
    top_k, top_p, min_p, typical_p = draws.filters
    return ops.sample_filtered(logits, draws.inv_temperature, top_k, top_p, min_p, draws.uniforms, typical_p,
                               policy=policy)


class SamplingBatch:
    """The parameters of a step's sampling rows: which rows draw at random (`random_rows`, their
    `Draws` as tensors), which report logprobs and how many."""

    def __init__(self, params: list[SamplingParams], streams: list[str], token_indices: list[int],
                 device: torch.device | str = "cpu") -> None:
        self.size = len(params)
        self.logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None or p.num_candidates > p.n]
        self.num_logprobs = [params[i].logprobs or 0 for i in self.logprob_rows]
        random = Draws()
        for i, p in enumerate(params):
            random.add(i, p, streams[i], token_indices[i])
        self.random_rows = random.rows
        if self.random_rows:
            self.draws = random.tensors().slice(0, len(self.random_rows), device)


def argmax_tokens(logits: torch.Tensor, first_row: int = 0) -> torch.Tensor:
    """The greedy token of each row: its first maximum."""
    return logits.max(dim=-1).indices  # first maximum on ties (faster than argmax)


class TokenPlan:
    """A step's tokens taken straight from each group of logits rows (`engine.sample.head.choose_tokens`),
    without keeping the logits: the argmax, and for the rows of `draws` (sorted) the inverse-CDF
    draw that `Sampler` makes for a random row (`draw`, the same `Draws`), so a row gets the same
    token either way (under the same `policy`). Every other row is greedy."""

    def __init__(self, draws: Draws, policy: OpsPolicy = FASTEST) -> None:
        self.draws = draws
        self.policy = policy
        self.random_rows = draws.rows
        self.tensors = draws.tensors()

    def only_random(self) -> TokenPlan:
        """The plan of the random rows alone, renumbered from 0 in their order."""
        return TokenPlan(self.draws.renumbered(), self.policy)

    def __call__(self, logits: torch.Tensor, first_row: int) -> torch.Tensor:
        lo = bisect.bisect_left(self.random_rows, first_row)
        hi = bisect.bisect_left(self.random_rows, first_row + logits.shape[0])
        if hi == lo:
            return argmax_tokens(logits)
        if hi - lo == logits.shape[0]:
            return draw(logits, self.tensors.slice(lo, hi, logits.device), self.policy)
        tokens = argmax_tokens(logits)
        local = torch.tensor([r - first_row for r in self.random_rows[lo:hi]], dtype=torch.long, device=logits.device)
        tokens[local] = draw(logits.index_select(0, local), self.tensors.slice(lo, hi, logits.device), self.policy)
        return tokens


class Sampler:
    """Stateless; one call per engine step. Returns int64 token ids, one per row. `policy`: the
    engine's (`ops.policy`), which the draws run under."""

    def __init__(self, policy: OpsPolicy = FASTEST) -> None:
        self.policy = policy

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        if logits.dim() != 2 or logits.shape[0] != batch.size:
            raise ValueError(f"logits must be [{batch.size}, vocab], one row per spec; got {list(logits.shape)}")
        if len(batch.random_rows) == batch.size:
            return draw(logits, batch.draws, self.policy)
        tokens = argmax_tokens(logits)  # greedy rows
        if batch.random_rows:
            rows = _rows(batch.random_rows, batch.size, logits.device)
            tokens[rows] = draw(logits[rows], batch.draws, self.policy)
        return tokens


class Logprobs:
    """Logprobs of a batch's rows that ask, taken from the logits before any processor runs."""

    def __init__(self, logits: torch.Tensor, batch: SamplingBatch) -> None:
        self.rows = batch.logprob_rows
        self.num = batch.num_logprobs
        if not self.rows:
            return
        index = _rows(self.rows, batch.size, logits.device)
        # log_softmax sums each row on its own, in one order; torch.logsumexp splits a row's sum
        # between threads when the batch has fewer rows than threads (a row's logprob then
        # depended on what else was in its step).
        self.logp = torch.log_softmax(logits[index].float(), dim=-1)
        k = max(self.num)
        self.top_values: torch.Tensor | None = None
        self.top_ids: torch.Tensor | None = None
        if k:
            self.top_values, self.top_ids = torch.topk(self.logp, k, dim=-1)

    def gather(self, tokens: torch.Tensor) -> tuple[list[float], list[list[tuple[int, float]]]]:
        """Per logprob row: the chosen token's logprob and its top alternatives."""
        if not self.rows:
            return [], []
        chosen = tokens[_rows(self.rows, tokens.shape[0], tokens.device)].unsqueeze(1)
        values = self.logp.gather(1, chosen).squeeze(1).tolist()
        tops: list[list[tuple[int, float]]] = [[] for _ in self.rows]
        if self.top_values is not None and self.top_ids is not None:
            top_values = self.top_values.tolist()
            top_ids = self.top_ids.tolist()
            for j, n in enumerate(self.num):
                tops[j] = list(zip(top_ids[j][:n], top_values[j][:n], strict=True))
        return values, tops


FILTERS = ("top_k", "top_p", "min_p", "typical_p")  # SamplingParams' fields, in `ops.sample_filtered`'s order
_filter_values = operator.attrgetter(*FILTERS)


def is_filtered(p: SamplingParams) -> bool:
    """True when a random row's distribution is cut by top-k, top-p, min-p or typical-p."""
    return p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 or p.typical_p < 1.0


def filter_tensors(filters: tuple[list[Any], ...], device: torch.device | str = "cpu") -> tuple[torch.Tensor, ...]:
    """The per-row filters (`FILTERS`' values) as `ops.sample_filtered` takes them: int64 top-k, fp32 others."""
    top_k, *masses = filters
    return (torch.tensor(top_k, dtype=torch.int64, device=device),
            *(torch.tensor(values, dtype=torch.float32, device=device) for values in masses))


def _rows(rows: list[int], batch: int, device: torch.device) -> torch.Tensor | slice:
    """Index for a subset of rows; a plain slice (no copy) when it is the whole batch."""
    if len(rows) == batch:
        return slice(None)
    return torch.tensor(rows, dtype=torch.long, device=device)

