"""User-facing sampling parameters, validated once at admission. Torch-free."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

MAX_LOGPROBS = 20
GREEDY_EPS = 1e-5  # temperatures below this are treated as greedy (argmax), as vLLM does
_INT64_MIN, _UINT64_MAX = -(2**63), 2**64 - 1  # what msgpack can carry


@dataclass(slots=True)
class SamplingParams:
    """How to pick the next tokens of one request (vLLM / OpenAI semantics).

    `top_k` of 0 or -1 means off. `logprobs` None returns none, 0 the sampled token's
    logprob, k > 0 also the k most likely alternatives. `best_of` defaults to `n`; with
    beam search it is the beam width. `early_stopping` is False, True or "never" (the
    Hugging Face beam-search stopping rules)."""

    n: int = 1
    best_of: int | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        self._check_counts()
        self._check_randomness()
        self._check_lengths()
        self._check_beam_search()

    @property
    def is_greedy(self) -> bool:
        """True when the sampler should take the argmax (temperature ~ 0, no beam search)."""
        return self.temperature < GREEDY_EPS and not self.use_beam_search

    @property
    def num_candidates(self) -> int:
        """Sequences generated per request: `best_of` (the beam width for beam search) or `n`."""
        return self.best_of if self.best_of is not None else self.n

    def to_dict(self) -> dict[str, Any]:
        """Plain types only, ready for msgpack."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["stop_token_ids"] = list(self.stop_token_ids)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SamplingParams:
        """Inverse of `to_dict`; unknown keys are ignored (newer senders), values validated."""
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in known}
        if "stop_token_ids" in kwargs:
            kwargs["stop_token_ids"] = list(kwargs["stop_token_ids"])
        return cls(**kwargs)

    def _check_counts(self) -> None:
        _require_int("n", self.n)
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if self.best_of is not None:
            _require_int("best_of", self.best_of)
            if self.best_of < self.n:
                raise ValueError(f"best_of must be >= n (got best_of={self.best_of}, n={self.n})")
        if self.logprobs is not None:
            _require_int("logprobs", self.logprobs)
            if not 0 <= self.logprobs <= MAX_LOGPROBS:
                raise ValueError(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}")

    def _check_randomness(self) -> None:
        if not _is_real(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        _require_int("top_k", self.top_k)
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (off) or a positive count, got {self.top_k}")
        if not _is_real(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None:
            _require_int("seed", self.seed)
            if not _INT64_MIN <= self.seed <= _UINT64_MAX:
                raise ValueError(f"seed must fit in 64 bits, got {self.seed}")

    def _check_lengths(self) -> None:
        _require_int("max_tokens", self.max_tokens)
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        _require_int("min_tokens", self.min_tokens)
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be between 0 and max_tokens={self.max_tokens}, got {self.min_tokens}"
            )
        for token_id in self.stop_token_ids:
            _require_int("stop_token_ids entries", token_id)
            if token_id < 0:
                raise ValueError(f"stop_token_ids must be non-negative token ids, got {token_id}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")

    def _check_beam_search(self) -> None:
        if not isinstance(self.use_beam_search, bool):
            raise ValueError(f"use_beam_search must be true or false, got {self.use_beam_search!r}")
        if self.early_stopping not in (False, True, "never"):
            raise ValueError(f'early_stopping must be true, false or "never", got {self.early_stopping!r}')
        if not _is_real(self.length_penalty):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}")
        if not self.use_beam_search:
            if self.early_stopping is not False:
                raise ValueError("early_stopping only applies to beam search; set use_beam_search=true")
            if self.length_penalty != 1.0:
                raise ValueError("length_penalty only applies to beam search; set use_beam_search=true")
            return
        if self.temperature > GREEDY_EPS:
            raise ValueError(
                f"beam search is deterministic and needs temperature=0, got temperature={self.temperature}"
            )
        if self.top_p != 1.0 or self.top_k not in (-1, 0) or self.min_p != 0.0:
            raise ValueError("beam search does not use top_p, top_k or min_p; leave them at their defaults")


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _require_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
