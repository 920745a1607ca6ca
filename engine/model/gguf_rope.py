"""A GGUF file's rotary embedding as transformers rope parameters (`engine.model.rope` reads them).

llama.cpp's loader reads, for every architecture: `{arch}.rope.freq_base`; `.rope.scaling.type`
(absent: linear), `.rope.scaling.factor` (or the old `.rope.scale_linear`; absent or 0: no
scaling), `.rope.scaling.original_context_length` (absent: the context length), and
`.rope.scaling.attn_factor` (a multiplier of YaRN's attention scale); its converter writes YaRN's
`.yarn_beta_fast` / `_slow` / `.yarn_attn_factor` (transformers' `attention_factor`) /
`.yarn_ext_factor` from the checkpoint's config; and Llama 3.x's `llama3` scaling as the
`rope_freqs.weight` tensor, per-frequency divisors of each theta (`freq_factors` here).

Mapped: none, linear, yarn (with or without `rope_freqs`). Refused by name (`GGUFRopeError`): other
scaling types (longrope, which llama.cpp reads from `rope_factors_*` tensors), NTK `alpha`,
`yarn_log_multiplier`, a `yarn_ext_factor` other than 1 (the YaRN ramp transformers runs), both
attention factors at once, and a `rope_freqs` tensor whose size is not half the rotary dimensions.
"""

from __future__ import annotations

import math
from typing import Any, Protocol


class GGUFRopeError(ValueError):
    """A GGUF file's rope metadata describes a rotation this module does not map (named)."""


class RopeMetadata(Protocol):
    """What is read of the file: metadata values (`{arch}` replaced) and the rope_freqs tensor."""

    arch: str

    def get(self, key: str, default: Any = ...) -> Any: ...

    def tensor_values(self, name: str) -> list[float] | None: ...


_YARN_BETAS = {"beta_fast": ("yarn_beta_fast", 32.0), "beta_slow": ("yarn_beta_slow", 1.0)}  # key, default
_REFUSED_KEYS = ("alpha", "yarn_log_multiplier")


def _float(value: Any) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (the config's value)."""
    import numpy as np

    return float(str(np.float32(value)))


def gguf_rope_parameters(meta: RopeMetadata, rotary_dim: int) -> dict[str, Any]:
    """The transformers `rope_parameters` of the file (`rope_type`, `rope_theta`, the type's keys)
    plus `freq_factors` when it carries `rope_freqs.weight`; GGUFRopeError for what does not map."""
    arch = meta.arch
    for key in _REFUSED_KEYS:
        if meta.get(f"{{arch}}.rope.scaling.{key}", None) is not None:
            raise GGUFRopeError(f"a {arch} GGUF with rope.scaling.{key} is not supported")
    kind = str(meta.get("{arch}.rope.scaling.type", "linear") or "linear")
    factor = meta.get("{arch}.rope.scaling.factor", None)
    if factor is None:
        factor = meta.get("{arch}.rope.scale_linear", None)
    factor = _float(factor) if factor else 1.0
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": _float(meta.get("{arch}.rope.freq_base", 10000.0))}
    if kind == "linear" and factor != 1.0:
        params |= {"rope_type": "linear", "factor": factor}
    elif kind == "yarn":
        params |= _yarn(meta, factor)
    elif kind not in ("none", "linear"):
        raise GGUFRopeError(f"a {arch} GGUF with rope scaling {kind!r} is not supported (mapped: none, linear, yarn)")
    elif meta.get("{arch}.rope.scaling.attn_factor", None) not in (None, 1.0):
        raise GGUFRopeError(f"a {arch} GGUF with rope.scaling.attn_factor without yarn scaling is not supported")
    factors = meta.tensor_values("rope_freqs.weight")
    if factors is not None:
        if len(factors) != rotary_dim // 2 or not all(f > 0 and math.isfinite(f) for f in factors):
            raise GGUFRopeError(f"a {arch} GGUF whose rope_freqs.weight has {len(factors)} entries (positive) is not "
                                f"supported: {rotary_dim} rotary dims need {rotary_dim // 2}")
        params["freq_factors"] = [float(f) for f in factors]
    return params


def _yarn(meta: RopeMetadata, factor: float) -> dict[str, Any]:
    """YaRN as transformers runs it: ramp between beta_fast and beta_slow over the original context,
    attention scale 0.1 ln(factor) + 1 unless given (`yarn_attn_factor`; llama.cpp's `attn_factor`
    multiplies that default)."""
    arch = meta.arch
    ext = meta.get("{arch}.rope.scaling.yarn_ext_factor", None)
    if ext is not None and _float(ext) != 1.0:
        raise GGUFRopeError(f"a {arch} GGUF with rope.scaling.yarn_ext_factor {_float(ext)} is not supported (1 only)")
    original = meta.get("{arch}.rope.scaling.original_context_length", None)
    if original is None:
        original = meta.get("{arch}.context_length")
    params: dict[str, Any] = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": int(original)}
    params |= {name: _float(meta.get(f"{{arch}}.rope.scaling.{key}", default))
               for name, (key, default) in _YARN_BETAS.items()}
    given = meta.get("{arch}.rope.scaling.yarn_attn_factor", None)
    multiplier = meta.get("{arch}.rope.scaling.attn_factor", None)
    if given is not None and multiplier is not None:
        raise GGUFRopeError(f"a {arch} GGUF with both rope.scaling.yarn_attn_factor and attn_factor is not supported")
    if given is not None:
        params["attention_factor"] = _float(given)
    elif multiplier is not None and _float(multiplier) != 1.0:
        default = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
        params["attention_factor"] = default * _float(multiplier)
    return params
