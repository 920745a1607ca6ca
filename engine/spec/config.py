"""`speculative_config` as vLLM spells it: {"method": "ngram", "num_speculative_tokens": K,
"prompt_lookup_min": a, "prompt_lookup_max": b}, plus `disable_by_batch_size` (vLLM's name: no
proposals while more sequences than this run) and pagedserve's `min_acceptance_rate` (a sequence
whose recent proposals are accepted less often than this stops proposing for a while)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

METHODS = ("ngram",)
DEFAULT_LOOKUP_MIN = 2
DEFAULT_LOOKUP_MAX = 5


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Validated speculative-decoding settings."""

    num_speculative_tokens: int
    method: str = "ngram"
    prompt_lookup_min: int = DEFAULT_LOOKUP_MIN
    prompt_lookup_max: int = DEFAULT_LOOKUP_MAX
    disable_by_batch_size: int = 4
    min_acceptance_rate: float = 0.2

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {METHODS}, got {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= 64:
            raise ValueError("speculative_config.num_speculative_tokens must be in [1, 64]")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max <= 64:
            raise ValueError("speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max <= 64")
        if self.disable_by_batch_size < 1:
            raise ValueError("speculative_config.disable_by_batch_size must be >= 1")
        if not 0.0 <= self.min_acceptance_rate <= 1.0:
            raise ValueError("speculative_config.min_acceptance_rate must be in [0, 1]")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SpeculativeConfig:
        """Parse the JSON form; unknown keys are refused. `prompt_lookup_min` alone sets max to it
        (at least the default max), `prompt_lookup_max` alone keeps min at most max."""
        known = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
                 "disable_by_batch_size", "min_acceptance_rate"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown}")
        if "num_speculative_tokens" not in data:
            raise ValueError("speculative_config needs num_speculative_tokens")
        values = dict(data)
        lo, hi = values.get("prompt_lookup_min"), values.get("prompt_lookup_max")
        if lo is not None and hi is None:
            values["prompt_lookup_max"] = max(int(lo), DEFAULT_LOOKUP_MAX)
        if hi is not None and lo is None:
            values["prompt_lookup_min"] = min(int(hi), DEFAULT_LOOKUP_MIN)
        for key in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size"):
            if key in values and (isinstance(values[key], bool) or not isinstance(values[key], int)):
                raise ValueError(f"speculative_config.{key} must be an integer")
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
