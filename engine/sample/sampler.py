"""Turn a batch of logits into tokens: greedy, temperature, top-k, top-p, min-p, seeded.

Every random row draws one uniform number derived only from (seed, sample stream, token index)
and inverts the CDF of its filtered distribution in token-id order. Filters are value
thresholds (ties at the cut are kept), so a row's token depends on nothing but its own
logits and key, never on the other rows, their order, or which code path the batch took.
A preempted or resumed request therefore continues exactly as it would have.

Logprobs are log_softmax of the *unmodified* logits (before temperature and filtering), as
the OpenAI API and vLLM report them: the model's own probability of the token.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from engine.sampling_params import GREEDY_EPS, SamplingParams

TOP_P_PROBE = 1024  # top-p first looks at this many most likely tokens, sorts the full row if short


@dataclass(frozen=True, slots=True)
class SeedKey:
    """Where a random draw comes from: the request's seed, the sample's stream
    (`engine.sched.sequence.sample_stream`, e.g. "sample/2") and the generated-token index."""

    seed: int | None
    stream: str
    token_index: int

    def uniform(self) -> float:
        """A number in [0, 1) with 23 random bits, exact in fp32 and strictly below 1 after scaling."""
        text = f"{self.seed}\x1f{self.stream}\x1f{self.token_index}".encode()
        bits = int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")
        return (bits >> 41) / float(1 << 23)


@dataclass(frozen=True, slots=True)
class SampleSpec:
    """One row of a sampling batch. `key` None (or temperature ~ 0) means greedy (argmax)."""

    key: SeedKey | None = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    num_logprobs: int | None = None

    @classmethod
    def from_params(cls, params: SamplingParams, stream: str, token_index: int) -> SampleSpec:
        key = None if params.is_greedy else SeedKey(params.seed, stream, token_index)
        return cls(key, params.temperature, params.top_k, params.top_p, params.min_p, params.logprobs)


@dataclass(frozen=True, slots=True)
class SampleResult:
    """The chosen token, its logprob, and the most likely alternatives when asked for."""

    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]] | None = None


class Sampler:
    """Stateless; one call per engine step."""

    def __call__(self, logits: torch.Tensor, specs: list[SampleSpec]) -> list[SampleResult]:
        if logits.dim() != 2 or logits.shape[0] != len(specs):
            shape = list(logits.shape)
            raise ValueError(f"logits must be [{len(specs)}, vocab], one row per spec; got {shape}")
        logits = logits.float()
        tokens = torch.empty(len(specs), dtype=torch.long, device=logits.device)
        is_random = [s.key is not None and s.temperature >= GREEDY_EPS for s in specs]
        greedy = [i for i, r in enumerate(is_random) if not r]
        random = [i for i, r in enumerate(is_random) if r]
        if greedy:
            rows = _rows(greedy, len(specs), logits.device)
            tokens[rows] = logits[rows].max(dim=-1).indices  # first maximum on ties, faster than argmax
        if random:
            rows = _rows(random, len(specs), logits.device)
            tokens[rows] = _draw(logits[rows], [specs[i] for i in random])
        return _results(logits, tokens, specs)


def _draw(logits: torch.Tensor, specs: list[SampleSpec]) -> torch.Tensor:
    dev, vocab = logits.device, logits.shape[-1]
    temps = torch.tensor([s.temperature for s in specs], device=dev).unsqueeze(1)
    scaled = logits / temps
    ks = [s.top_k if 0 < s.top_k < vocab else vocab for s in specs]
    if min(ks) < vocab:
        _mask_top_k(scaled, torch.tensor(ks, device=dev))
    probs = torch.softmax(scaled, dim=-1)
    cut = [i for i, s in enumerate(specs) if s.top_p < 1.0]
    if cut:
        rows = _rows(cut, len(specs), dev)
        probs[rows] = _mask_top_p(probs[rows], [specs[i].top_p for i in cut])
    min_p = torch.tensor([s.min_p for s in specs], device=dev).unsqueeze(1)
    if bool((min_p > 0).any()):
        probs.masked_fill_(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
    cdf = probs.cumsum(dim=-1)
    uniforms = torch.tensor([s.key.uniform() for s in specs if s.key], device=dev).unsqueeze(1)
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


def _results(logits: torch.Tensor, tokens: torch.Tensor, specs: list[SampleSpec]) -> list[SampleResult]:
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    chosen = (logits.gather(1, tokens.unsqueeze(1)) - lse).squeeze(1).tolist()
    token_ids = tokens.tolist()
    wanted = [i for i, s in enumerate(specs) if s.num_logprobs]
    top: dict[int, list[tuple[int, float]]] = {}
    if wanted:
        rows = _rows(wanted, len(specs), logits.device)
        k = max(specs[i].num_logprobs or 0 for i in wanted)
        values, ids = torch.topk(logits[rows], min(k, logits.shape[-1]), dim=-1)
        top_values, top_ids = (values - lse[rows]).tolist(), ids.tolist()
        for row, i in enumerate(wanted):
            n = specs[i].num_logprobs or 0
            top[i] = list(zip(top_ids[row][:n], top_values[row][:n], strict=True))
    return [
        SampleResult(token_ids[i], chosen[i], top.get(i, [] if s.num_logprobs == 0 else None))
        for i, s in enumerate(specs)
    ]


def _rows(rows: list[int], batch: int, device: torch.device) -> torch.Tensor | slice:
    """Index for a subset of rows; a plain slice (no copy) when it is the whole batch."""
    if len(rows) == batch:
        return slice(None)
    return torch.tensor(rows, dtype=torch.long, device=device)
