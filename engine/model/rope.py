"""Rotary position embedding: inverse frequencies per `rope_type` and the cos/sin rotation.

Supported: default, linear, dynamic, llama3, yarn, longrope. transformers' `dynamic` (NTK)
rescales only once a sequence grows past max_position_embeddings, which the engine never serves,
so within it `dynamic` is the default rotation. `longrope` uses its short factors up to
original_max_position_embeddings and switches every position to the long ones past it (which
would change the rotation of keys already cached): the engine serves no longer context
(`ModelSpec.exact_context`). Partial rotary (`rotary_dim` <
head_dim, Phi-3/Phi-4-mini) is served by a table whose unrotated slots are the identity and a
fixed permutation of each q/k head's dimensions (`partial_rotary_order`). Other types are
rejected with a clear error instead of being approximated.

`freq_factors` (a list of head_dim/2 floats beside any of default, linear, dynamic and yarn) are
llama.cpp's per-frequency divisors (a GGUF's `rope_freqs.weight`, how its converter stores Llama
3.x's `llama3` scaling): each frequency of the type's rotation is divided by its factor, as
llama.cpp's rope divides each theta before its linear / YaRN step; the cos/sin scale is unchanged.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")
FREQ_FACTOR_TYPES = ("default", "linear", "dynamic", "yarn")  # the types `freq_factors` divide


def _base_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: scale long wavelengths by `factor`, keep short ones, blend in between."""
    factor = float(params["factor"])
    low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
    old_len = float(params["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(theta: float, dim: int, params: dict[str, Any], max_pos: int) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies, extrapolate high ones, ramp between; scale cos/sin."""
    old_len = params["original_max_position_embeddings"]
    factor = params.get("factor") or max_pos / old_len
    attention = params.get("attention_factor")
    if attention is None:
        mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
        attention = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
                     if mscale and mscale_all else _yarn_mscale(factor))

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(params.get("beta_fast") or 32), correction_dim(params.get("beta_slow") or 1)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp
    base = _base_inv_freq(theta, dim)
    return base / factor * (1 - extrapolate) + base * extrapolate, float(attention)


def _longrope(theta: float, dim: int, params: dict[str, Any], max_pos: int) -> tuple[torch.Tensor, float]:
    """LongRoPE with its short factors (the rotation up to original_max_position_embeddings), and
    its attention factor (default sqrt(1 + ln(factor) / ln(original length)))."""
    old_len = int(params["original_max_position_embeddings"])
    factor = params.get("factor") or max_pos / old_len
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_len))
    short = torch.tensor(params["short_factor"], dtype=torch.float32)
    if short.shape != (dim // 2,):
        raise ValueError(f"longrope short_factor has {short.numel()} entries; rotary dimension {dim} needs {dim // 2}")
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (short * theta**exponents), float(attention)


def partial_rotary_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """`order[j]`: the HF head dimension that sits at position j of a permuted q/k head. HF rotates
    dims `[0, rotary_dim)` in half-split pairs `(i, i + rotary_dim/2)` and passes the rest; the
    kernels rotate pairs `(j, j + head_dim/2)`. The order puts HF pair i at `(i, i + head_dim/2)`
    and the passed dims in the remaining slots, whose table entries are the identity. q and k
    permuted alike keep every q.k, so attention is unchanged (v and o_proj are untouched)."""
    half, rot_half = head_dim // 2, rotary_dim // 2
    passed = torch.arange(rotary_dim, head_dim)
    low = torch.cat([torch.arange(rot_half), passed[: half - rot_half]])
    high = torch.cat([torch.arange(rot_half, rotary_dim), passed[half - rot_half :]])
    return torch.cat([low, high])


def rope_inv_freq(params: dict[str, Any], head_dim: int, max_pos: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies `[head_dim // 2]` (fp32) and the cos/sin scale for these rope parameters
    (`head_dim`: the rotated dimensions, all of a head's unless partial), each divided by its
    `freq_factors` entry when those are given (module docstring)."""
    inv_freq, scale = _type_inv_freq(params, head_dim, max_pos)
    factors = params.get("freq_factors")
    if factors is None:
        return inv_freq, scale
    rope_type = params.get("rope_type", "default")
    if rope_type not in FREQ_FACTOR_TYPES:
        raise ValueError(f"rope freq_factors with rope_type {rope_type!r} are not supported "
                         f"(supported with: {', '.join(FREQ_FACTOR_TYPES)})")
    divisors = torch.tensor([float(f) for f in factors], dtype=torch.float32)
    if divisors.shape != inv_freq.shape or not bool((divisors > 0).all()):
        raise ValueError(f"rope freq_factors: {divisors.numel()} entries for {inv_freq.numel()} frequencies "
                         "(each must be > 0)")
    return inv_freq / divisors, scale


def _type_inv_freq(params: dict[str, Any], head_dim: int, max_pos: int) -> tuple[torch.Tensor, float]:
    """`rope_inv_freq` of the rope type alone."""
    rope_type = params.get("rope_type", "default")
    theta = float(params.get("rope_theta", 10000.0))
    if rope_type in ("default", "dynamic"):  # dynamic: see the module docstring
        return _base_inv_freq(theta, head_dim), 1.0
    if rope_type == "linear":
        return _base_inv_freq(theta, head_dim) / float(params["factor"]), 1.0
    if rope_type == "llama3":
        return _llama3(_base_inv_freq(theta, head_dim), params), 1.0
    if rope_type == "yarn":
        return _yarn(theta, head_dim, params, max_pos)
    if rope_type == "longrope":
        return _longrope(theta, head_dim, params, max_pos)
    supported = ", ".join(SUPPORTED_ROPE_TYPES)
    raise ValueError(f"unsupported rope_scaling type {rope_type!r}; supported: {supported}")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(
    query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate `query [T, H, D]` and `key [T, KVH, D]` by per-token `cos/sin [T, 1, D]`."""
    return query * cos + _rotate_half(query) * sin, key * cos + _rotate_half(key) * sin


class RotaryEmbedding(nn.Module):
    """RoPE (the half-split layout of HF Llama) for `[T, heads, head_dim]` queries and keys.

    It owns the fp32 table `[positions, head_dim]` (cosines of the head_dim/2 frequencies, then their
    sines, the variant's scale folded in) that `ops.rotary_embedding_and_cache` reads by position.
    """

    def __init__(self, params: dict[str, Any], head_dim: int, max_pos: int, rotary_dim: int | None = None) -> None:
        """`rotary_dim` < head_dim: partial rotary; the table's last `(head_dim - rotary_dim) / 2`
        frequency slots are the identity (cos 1, sin 0), for heads in `partial_rotary_order`."""
        super().__init__()
        self.max_pos = max_pos
        self.identity_slots = (head_dim - (rotary_dim or head_dim)) // 2
        with torch.device("cpu"):  # plain tensors, not buffers: real even when built on "meta"
            self.inv_freq, self.scale = rope_inv_freq(params, rotary_dim or head_dim, max_pos)
            self._table = torch.empty(0, head_dim)

    def table(self, positions: torch.Tensor) -> torch.Tensor:
        """The cos/sin table on the positions' device, covering every position in `positions`.

        On CUDA it covers max_position_embeddings from the start (the engine never goes past it),
        so no step pays a device sync to read the largest position; on the CPU it grows on demand.
        """
        if positions.device.type == "cuda":
            needed = self.max_pos
        else:
            needed = int(positions.max()) + 1 if positions.numel() else 0
        if self._table.shape[0] < needed or self._table.device != positions.device:
            length = max(needed, 2 * self._table.shape[0], min(4096, self.max_pos))
            pos = torch.arange(length, dtype=torch.float32, device=positions.device)
            freqs = torch.outer(pos, self.inv_freq.to(positions.device))
            if self.identity_slots:
                ones = torch.ones(length, self.identity_slots, device=positions.device)
                self._table = torch.cat((freqs.cos() * self.scale, ones, freqs.sin() * self.scale, 0 * ones), dim=-1)
            else:
                self._table = torch.cat((freqs.cos(), freqs.sin()), dim=-1) * self.scale
        return self._table

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """`cos, sin [T, 1, head_dim]` for the positions in `dtype`, in the layout `apply_rotary` takes."""
        cos, sin = self.table(positions)[positions].to(dtype).chunk(2, dim=-1)
        return torch.cat((cos, cos), dim=-1)[:, None, :], torch.cat((sin, sin), dim=-1)[:, None, :]

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate `query [T, H, D]` and `key [T, KVH, D]` by their token positions (out of place)."""
        return apply_rotary(query, key, *self.cos_sin(positions, query.dtype))
