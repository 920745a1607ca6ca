"""`speculative_config` as vLLM spells it: {"method": "ngram", "num_speculative_tokens": K,
"prompt_lookup_min": a, "prompt_lookup_max": b} or {"method": "suffix", "num_speculative_tokens": K,
"suffix_decoding_max_tree_depth": D, "suffix_decoding_max_cached_requests": R,
"suffix_decoding_max_spec_factor": f, "suffix_decoding_min_token_prob": p} (K defaults to D for
suffix, as in vLLM), plus `disable_by_batch_size` (vLLM's name: no proposals while more sequences
than this run) and pagedserve's `min_acceptance_rate` (a sequence whose recent proposals are
accepted less often than this stops proposing for a while). Keys of the other method are refused.

vLLM's suffix defaults are kept except `max_cached_requests`: 10,000 there (a C++ tree), 128 here,
where a cached output costs ~120 bytes x tokens x depth in Python (~2.9 MB for 1,000 tokens at 24)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

METHODS = ("ngram", "suffix")
DEFAULT_LOOKUP_MIN = 2
DEFAULT_LOOKUP_MAX = 5
DEFAULT_TREE_DEPTH = 24
NGRAM_KEYS = {"prompt_lookup_min", "prompt_lookup_max"}
SUFFIX_KEYS = {"suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests",
               "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob"}


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Validated speculative-decoding settings."""

    num_speculative_tokens: int
    method: str = "ngram"
    prompt_lookup_min: int = DEFAULT_LOOKUP_MIN
    prompt_lookup_max: int = DEFAULT_LOOKUP_MAX
    disable_by_batch_size: int = 4
    min_acceptance_rate: float = 0.2
    suffix_decoding_max_tree_depth: int = DEFAULT_TREE_DEPTH  # longest substring the suffix tries count
    suffix_decoding_max_cached_requests: int = 128  # finished outputs in the global trie (FIFO), 0: none
    suffix_decoding_max_spec_factor: float = 1.0  # at most factor x matched length proposals
    suffix_decoding_min_token_prob: float = 0.1  # stop when the estimated probability falls below

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
        if not 2 <= self.suffix_decoding_max_tree_depth <= 256:
            raise ValueError("speculative_config.suffix_decoding_max_tree_depth must be in [2, 256]")
        if self.suffix_decoding_max_cached_requests < 0:
            raise ValueError("speculative_config.suffix_decoding_max_cached_requests must be >= 0")
        if self.suffix_decoding_max_spec_factor <= 0:
            raise ValueError("speculative_config.suffix_decoding_max_spec_factor must be > 0")
        if not 0.0 <= self.suffix_decoding_min_token_prob <= 1.0:
            raise ValueError("speculative_config.suffix_decoding_min_token_prob must be in [0, 1]")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SpeculativeConfig:
        """Parse the JSON form; unknown keys are refused. `prompt_lookup_min` alone sets max to it
        (at least the default max), `prompt_lookup_max` alone keeps min at most max."""
        method = data.get("method", "ngram")
        known = {"method", "num_speculative_tokens", "disable_by_batch_size", "min_acceptance_rate"}
        known |= SUFFIX_KEYS if method == "suffix" else NGRAM_KEYS
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown} for method {method!r}")
        values = dict(data)
        if "num_speculative_tokens" not in data:
            if method != "suffix":
                raise ValueError("speculative_config needs num_speculative_tokens")
            values["num_speculative_tokens"] = values.get("suffix_decoding_max_tree_depth", DEFAULT_TREE_DEPTH)
        lo, hi = values.get("prompt_lookup_min"), values.get("prompt_lookup_max")
        if lo is not None and hi is None:
            values["prompt_lookup_max"] = max(int(lo), DEFAULT_LOOKUP_MAX)
        if hi is not None and lo is None:
            values["prompt_lookup_min"] = min(int(hi), DEFAULT_LOOKUP_MIN)
        for key in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size",
                    "suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests"):
            if key in values and (isinstance(values[key], bool) or not isinstance(values[key], int)):
                raise ValueError(f"speculative_config.{key} must be an integer")
        for key in ("min_acceptance_rate", "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob"):
            if key in values and (isinstance(values[key], bool) or not isinstance(values[key], int | float)):
                raise ValueError(f"speculative_config.{key} must be a number")
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
