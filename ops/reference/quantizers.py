"""Simple reference quantizers for the formats the `gguf` package cannot quantize (K-quants, IQ4):
valid blocks in ggml's layouts (ops/reference/formats.py), for test files and tools.

Each rounds to nearest under scales taken from the block's range (no search for the best scales
as llama.cpp's quantizer does), so its error is larger than llama.cpp's but its blocks are what
a reader must decode: every field is filled from the published layout, the scales' 6-bit and
4-bit packings included. ``quantize(weight, name)`` -> uint8 ``[N, K / block_size * block_bytes]``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ops.reference import formats


def _half(x: Tensor) -> tuple[Tensor, Tensor]:
    """``(fp16 bytes [..., 2], the fp32 value the block stores)`` of fp32 ``x [...]``."""
    h = x.to(torch.float16)
    return h.unsqueeze(-1).view(torch.uint8), h.float()


def _div(x: Tensor, d: Tensor) -> Tensor:
    """``x / d``, 0 where ``d`` is 0."""
    return torch.where(d == 0, torch.zeros_like(x), x / torch.where(d == 0, torch.ones_like(d), d))


def _round(x: Tensor, lo: int, hi: int) -> Tensor:
    return x.round().clamp(lo, hi).to(torch.int32)


def _nibble_pack(low: Tensor, high: Tensor) -> Tensor:
    return (low | (high << 4)).to(torch.uint8)


def _affine(w: Tensor, levels: int, scale_max: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Super-block affine quantization of ``w [n, S, L]`` (S sub-blocks of L weights) as the K-quants
    with mins store it: ``w ~ (d sc_s) q - (dmin m_s)``, q in [0, levels], sc and m in [0, scale_max].
    Returns ``(d bytes, dmin bytes, sc, m, q)``."""
    lo = w.amin(-1).clamp(max=0)
    sub_scale, sub_min = (w.amax(-1) - lo) / levels, -lo
    d_bytes, d = _half(sub_scale.amax(-1) / scale_max)
    m_bytes, dmin = _half(sub_min.amax(-1) / scale_max)
    sc = _round(_div(sub_scale, d.unsqueeze(-1)), 0, scale_max)
    m = _round(_div(sub_min, dmin.unsqueeze(-1)), 0, scale_max)
    step = (d.unsqueeze(-1) * sc.float()).unsqueeze(-1)
    offset = (dmin.unsqueeze(-1) * m.float()).unsqueeze(-1)
    q = _round(_div(w + offset, step), 0, levels)
    return d_bytes, m_bytes, sc, m, q


def _pack_scales_mins_k4(sc: Tensor, m: Tensor) -> Tensor:
    """The 12 bytes of eight 6-bit scales and mins (``formats._scales_mins_k4``'s inverse)."""
    a = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    b = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    c = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    return torch.cat([a, b, c], dim=-1).to(torch.uint8)


def _q2_k(w: Tensor) -> Tensor:
    n = w.shape[0]
    d, dmin, sc, m, q = _affine(w.reshape(n, 16, 16), 3, 15)
    bits = q.reshape(n, 2, 4, 32) << (2 * torch.arange(4)).view(1, 1, 4, 1)
    return torch.cat([_nibble_pack(sc, m), bits.sum(2).to(torch.uint8).reshape(n, 64), d, dmin], dim=-1)


def _q4_k(w: Tensor) -> Tensor:
    n = w.shape[0]
    d, dmin, sc, m, q = _affine(w.reshape(n, 8, 32), 15, 63)
    chunks = q.reshape(n, 4, 2, 32)
    qs = _nibble_pack(chunks[:, :, 0], chunks[:, :, 1]).reshape(n, 128)
    return torch.cat([d, dmin, _pack_scales_mins_k4(sc, m), qs], dim=-1)


def _q5_k(w: Tensor) -> Tensor:
    n = w.shape[0]
    d, dmin, sc, m, q = _affine(w.reshape(n, 8, 32), 31, 63)
    chunks = (q & 0x0F).reshape(n, 4, 2, 32)
    qs = _nibble_pack(chunks[:, :, 0], chunks[:, :, 1]).reshape(n, 128)
    qh = ((q >> 4) << torch.arange(8).view(1, 8, 1)).sum(1).to(torch.uint8)  # bit s of byte l
    return torch.cat([d, dmin, _pack_scales_mins_k4(sc, m), qh, qs], dim=-1)


def _symmetric(w: Tensor, qmax: int, scale_max: int) -> tuple[Tensor, Tensor, Tensor]:
    """``w [n, S, L] ~ (d sc_s) q`` with q in [-qmax - 1, qmax] and sc in [-scale_max - 1, scale_max]:
    ``(d bytes, sc, q)``."""
    sub = w.abs().amax(-1) / qmax
    d_bytes, d = _half(sub.amax(-1) / scale_max)
    sc = _round(_div(sub, d.unsqueeze(-1)), -scale_max - 1, scale_max)
    q = _round(_div(w, (d.unsqueeze(-1) * sc.float()).unsqueeze(-1)), -qmax - 1, qmax)
    return d_bytes, sc, q


def _q3_k(w: Tensor) -> Tensor:
    n = w.shape[0]
    d, sc, q = _symmetric(w.reshape(n, 16, 16), 3, 31)
    u = (q + 4).reshape(n, 8, 32)  # [4h + j, l]: q = low - 4 unless the high bit is set
    hmask = ((u >> 2) << torch.arange(8).view(1, 8, 1)).sum(1).to(torch.uint8)
    qs = ((u & 3).reshape(n, 2, 4, 32) << (2 * torch.arange(4)).view(1, 1, 4, 1)).sum(2).to(torch.uint8)
    s = sc + 32
    low = _nibble_pack(s[:, :8] & 0x0F, s[:, 8:] & 0x0F)
    high = (((s >> 4) & 3).reshape(n, 4, 4) << (2 * torch.arange(4)).view(1, 4, 1)).sum(1).to(torch.uint8)
    return torch.cat([hmask, qs.reshape(n, 64), low, high, d], dim=-1)


def _q6_k(w: Tensor) -> Tensor:
    n = w.shape[0]
    d, sc, q = _symmetric(w.reshape(n, 16, 16), 31, 127)
    u = (q + 32).reshape(n, 2, 4, 32)  # [half, group, l]
    low = u & 0x0F
    ql = torch.stack([_nibble_pack(low[:, :, 0], low[:, :, 2]), _nibble_pack(low[:, :, 1], low[:, :, 3])], dim=2)
    qh = ((u >> 4) << (2 * torch.arange(4)).view(1, 1, 4, 1)).sum(2).to(torch.uint8)
    return torch.cat([ql.reshape(n, 128), qh.reshape(n, 64), sc.to(torch.int8).view(torch.uint8), d], dim=-1)


_IQ4 = torch.tensor(formats.IQ4_VALUES, dtype=torch.float32)


def _iq4_index(x: Tensor) -> Tensor:
    """The index of the nearest ``IQ4_VALUES`` entry to each of ``x``."""
    return (x.unsqueeze(-1) - _IQ4).abs().argmin(-1).to(torch.int32)


def _peak(w: Tensor) -> Tensor:
    """The signed value of largest magnitude along the last dim."""
    return w.gather(-1, w.abs().argmax(-1, keepdim=True)).squeeze(-1)


def _iq4_nl(w: Tensor) -> Tensor:
    n = w.shape[0]
    blocks = w.reshape(-1, 32)
    d_bytes, d = _half(_peak(blocks) / -127)  # the peak maps to -127, the table's widest entry
    q = _iq4_index(_div(blocks, d.unsqueeze(-1)))
    return torch.cat([d_bytes, _nibble_pack(q[:, :16], q[:, 16:])], dim=-1).reshape(n, -1)


def _iq4_xs(w: Tensor) -> Tensor:
    n = w.shape[0]
    sub = w.reshape(n, 8, 32)
    scale = _peak(sub) / -127
    d_bytes, d = _half(scale.abs().amax(-1) / 31)
    ls = _round(_div(scale, d.unsqueeze(-1)), -32, 31)
    q = _iq4_index(_div(sub, (d.unsqueeze(-1) * ls.float()).unsqueeze(-1)))
    s = ls + 32
    high = (((s >> 4) & 3).reshape(n, 2, 4) << (2 * torch.arange(4)).view(1, 1, 4)).sum(-1).to(torch.uint8)
    low = _nibble_pack(s[:, 0::2] & 0x0F, s[:, 1::2] & 0x0F)
    return torch.cat([d_bytes, high, low, _nibble_pack(q[..., :16], q[..., 16:]).reshape(n, 128)], dim=-1)


QUANTIZERS: dict[str, Callable[[Tensor], Tensor]] = {
    "Q2_K": _q2_k, "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k, "IQ4_NL": _iq4_nl, "IQ4_XS": _iq4_xs,
}


def quantize(weight: Tensor, name: str) -> Tensor:
    """uint8 ``[N, K / block_size * block_bytes]`` blocks of fp32 ``weight [N, K]`` in format ``name``
    (one of ``QUANTIZERS``); ValueError for another format or K not a multiple of its block."""
    fmt = formats.by_name(name)
    if name not in QUANTIZERS:
        raise formats.UnsupportedFormatError(f"no reference quantizer for {name}; these have one: {sorted(QUANTIZERS)}")
    rows, cols = weight.shape
    row_bytes = fmt.row_bytes(cols)
    blocks = weight.float().reshape(-1, fmt.block_size)
    out = QUANTIZERS[name](blocks)
    assert out.shape == (blocks.shape[0], fmt.block_bytes), (name, tuple(out.shape))
    return out.reshape(rows, row_bytes).contiguous()
