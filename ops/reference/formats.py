"""The GGML tensor formats pagedserve reads: one table, as ggml's ``type_traits`` is one table.

Per format: its name and ggml type id (``enum ggml_type``), weights per block (1 for the float
types, 32, or 256 for the K-quants and IQ4_XS), bytes per block, the reference dequantization
(plain torch, fp32 arithmetic in the order ggml's ``dequantize_row_*`` uses, so its results are
the bits the ``gguf`` package's reference gives) and how pagedserve runs a weight stored in it:

- ``PACKED``: kept in its blocks and run by the quantized kernels (ops/quant.py, csrc/cpu); the
  C++ ids in csrc/cpu/ops.h must equal these (tests/ops/test_formats.py parses the header);
- ``DEQUANTIZED``: no kernel reads its blocks; a weight is dequantized to fp32 at load;
- ``FLOAT``: F32/F16/BF16, widened to fp32 at load.

A name or id not in the table is refused (``UnsupportedFormatError``), never defaulted.

Block layouts (little-endian; ``d``/``dmin``/``m`` fp16; "nibbles" of n bytes: element j in the low
four bits of byte j, element j + n in the high four bits):

- Q4_0 (32, 18 B): d, 16 B nibbles; w = d (q - 8). Q4_1 (32, 20 B): d, m, nibbles; w = d q + m.
- Q5_0 (32, 22 B): d, qh (uint32: bit j is element j's fifth bit), nibbles; w = d (q - 16).
  Q5_1 (32, 24 B): d, m, qh, nibbles; w = d q + m.
- Q8_0 (32, 34 B): d, 32 int8; w = d q.
- IQ4_NL (32, 18 B): d, nibbles indexing the 16-entry non-linear table ``IQ4_VALUES``; w = d v[q].
- MXFP4 (32, 17 B): one E8M0 exponent byte e, nibbles indexing ``MXFP4_VALUES`` (the E2M1 values
  doubled, as ggml's ``kvalues_mxfp4``); w = d v[q] with d = 2^(e - 128), half the block scale, as
  ggml's ``ggml_e8m0_to_fp32_half`` builds it (subnormal for e < 2; e = 255 is 2^127, not NaN).
- Q2_K (256, 84 B): 16 B scales (16 sub-blocks of 16: low nibble scale, high nibble min), 64 B of
  2-bit q, d, dmin. Element 128h + 32j + l is bits 2j..2j+1 of q-byte 32h + l; w = (d sc) q - dmin m.
- Q3_K (256, 110 B): 32 B hmask, 64 B 2-bit q (as Q2_K), 12 B of 16 6-bit scales, d. Element
  128h + 32j + l's third bit is bit 4h + j of hmask byte l; q = low - 4 where that bit is 0;
  scale i: low 4 bits from byte i (i < 8) or the high nibble of byte i - 8, high 2 bits are bits
  2(i / 4) of byte 8 + i % 4; w = (d (s - 32)) q.
- Q4_K (256, 144 B): d, dmin, 12 B of eight 6-bit scales and mins (``_scales_mins_k4``), 128 B: 64-weight
  chunk c is the nibbles of bytes 32c..32c+31 (low: sub-block 2c, high: 2c + 1); w = (d sc) q - (dmin m).
- Q5_K (256, 176 B): as Q4_K with 32 B qh after the scales: sub-block s's fifth bit is bit s of qh byte l.
- Q6_K (256, 210 B): 128 B low nibbles, 64 B high 2-bit pairs, 16 int8 scales (one per 16
  weights), d. In half h, group g of 32: low 4 bits from ql[64h + 32(g % 2) + l] (low nibble for
  g < 2), high 2 bits are bits 2g of qh[32h + l]; w = (d sc) (q - 32).
- IQ4_XS (256, 136 B): d, uint16 high scale bits (2 per 32-weight sub-block), 4 B low scale nibbles,
  128 B: sub-block s is the nibbles of bytes 16s..16s+15 into ``IQ4_VALUES``; w = (d (ls - 32)) v[q].
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

PACKED = "packed"
DEQUANTIZED = "dequantized at load"
FLOAT = "float"

CHUNK_BLOCKS = 1 << 14  # blocks dequantized per step
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
_IQ4 = torch.tensor(IQ4_VALUES, dtype=torch.float32)
MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
_MXFP4 = torch.tensor(MXFP4_VALUES, dtype=torch.float32)


class UnsupportedFormatError(ValueError):
    """A tensor format pagedserve does not read (the message names it)."""


def _f16(b: Tensor, offset: int) -> Tensor:
    """fp32 ``[n, 1]`` of the fp16 at byte ``offset`` of each block ``[n, bytes]``."""
    return b[:, offset:offset + 2].contiguous().view(torch.float16).float()


def _nibbles(b: Tensor) -> Tensor:
    """``[..., 2m]`` uint8: the low nibbles of ``m`` bytes, then their high nibbles."""
    return torch.cat([b & 0x0F, b >> 4], dim=-1)


def _bits(b: Tensor, shifts: range, mask: int) -> Tensor:
    """``[..., len(shifts), m]``: ``(byte >> s) & mask`` of ``m`` bytes ``[..., m]`` for each shift."""
    by = torch.tensor(list(shifts), dtype=torch.uint8).view(-1, 1)
    return (b.unsqueeze(-2) >> by) & mask


def _q4_0(b: Tensor) -> Tensor:
    return _f16(b, 0) * (_nibbles(b[:, 2:]).to(torch.int32) - 8).float()


def _q4_1(b: Tensor) -> Tensor:
    return _f16(b, 0) * _nibbles(b[:, 4:]).float() + _f16(b, 2)


def _q5(b: Tensor, head: int) -> Tensor:
    """int32 ``[n, 32]`` 5-bit values of a Q5_0 / Q5_1 block whose qh starts at byte ``head``."""
    high = _bits(b[:, head:head + 4], range(8), 1).transpose(-1, -2).reshape(-1, 32)  # bit j of the uint32
    return (_nibbles(b[:, head + 4:]) | (high << 4)).to(torch.int32)


def _q5_0(b: Tensor) -> Tensor:
    return _f16(b, 0) * (_q5(b, 2) - 16).float()


def _q5_1(b: Tensor) -> Tensor:
    return _f16(b, 0) * _q5(b, 4).float() + _f16(b, 2)


def _q8_0(b: Tensor) -> Tensor:
    return _f16(b, 0) * b[:, 2:].contiguous().view(torch.int8).float()


def _iq4_nl(b: Tensor) -> Tensor:
    return _f16(b, 0) * _IQ4[_nibbles(b[:, 2:]).long()]


def e8m0_half(e: Tensor) -> Tensor:
    """fp32 2^(e - 128) of E8M0 exponent bytes (uint8), built from its bits as ggml does."""
    e = e.to(torch.int32)
    bits = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23)
    return bits.view(torch.float32)


def _mxfp4(b: Tensor) -> Tensor:
    return e8m0_half(b[:, :1]) * _MXFP4[_nibbles(b[:, 1:]).long()]


def _q2_k(b: Tensor) -> Tensor:
    n = b.shape[0]
    scales = b[:, :16]
    q = _bits(b[:, 16:80].reshape(n, 2, 32), range(0, 8, 2), 3).reshape(n, 16, 16)
    dl = (_f16(b, 80) * (scales & 0x0F).float()).unsqueeze(-1)
    ml = (_f16(b, 82) * (scales >> 4).float()).unsqueeze(-1)
    return (dl * q.float() - ml).reshape(n, 256)


def _q3_k(b: Tensor) -> Tensor:
    n = b.shape[0]
    low = _bits(b[:, 32:96].reshape(n, 2, 32), range(0, 8, 2), 3).to(torch.int32)  # [n, 2, 4, 32]
    high = _bits(b[:, :32], range(8), 1).reshape(n, 2, 4, 32).to(torch.int32)  # bit 4h + j of byte l
    q = (low - 4 * (1 - high)).reshape(n, 16, 16)
    packed = b[:, 96:108]
    s_low = _nibbles(packed[:, :8])
    s_high = _bits(packed[:, 8:12], range(0, 8, 2), 3).reshape(n, 16)
    scales = (s_low | (s_high << 4)).to(torch.int32) - 32
    dl = (_f16(b, 108) * scales.float()).unsqueeze(-1)
    return (dl * q.float()).reshape(n, 256)


def _scales_mins_k4(packed: Tensor) -> tuple[Tensor, Tensor]:
    """The eight 6-bit scales and eight 6-bit mins ``[n, 8]`` of a Q4_K / Q5_K block's 12 bytes:
    sub-block j < 4 from bytes j (scale) and j + 4 (min), low six bits; j >= 4 from the nibbles of
    byte j + 4 with the top two bits of bytes j - 4 (scale) and j (min) above them."""
    a, m, c = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = torch.cat([a & 0x3F, (c & 0x0F) | ((a >> 6) << 4)], dim=-1)
    mins = torch.cat([m & 0x3F, (c >> 4) | ((m >> 6) << 4)], dim=-1)
    return scales, mins


def _k4_affine(b: Tensor, q: Tensor) -> Tensor:
    """``(d sc) q - (dmin m)`` of a Q4_K / Q5_K block's ``q [n, 8, 32]`` (sub-blocks of 32)."""
    n = b.shape[0]
    scales, mins = _scales_mins_k4(b[:, 4:16])
    dl = (_f16(b, 0) * scales.float()).unsqueeze(-1)
    ml = (_f16(b, 2) * mins.float()).unsqueeze(-1)
    return (dl * q.float() - ml).reshape(n, 256)


def _q4_k(b: Tensor) -> Tensor:
    n = b.shape[0]
    return _k4_affine(b, _nibbles(b[:, 16:144].reshape(n, 4, 32)).reshape(n, 8, 32))


def _q5_k(b: Tensor) -> Tensor:
    n = b.shape[0]
    low = _nibbles(b[:, 48:176].reshape(n, 4, 32)).reshape(n, 8, 32)
    high = _bits(b[:, 16:48], range(8), 1)  # [n, 8, 32]: sub-block s is bit s
    return _k4_affine(b, low | (high << 4))


def _q6_k(b: Tensor) -> Tensor:
    n = b.shape[0]
    ql = b[:, :128].reshape(n, 2, 2, 32)  # [half, which 32 bytes, l]
    low = torch.stack([ql & 0x0F, ql >> 4], dim=2).reshape(n, 2, 4, 32)  # group g: nibble g // 2 of bytes g % 2
    high = _bits(b[:, 128:192].reshape(n, 2, 32), range(0, 8, 2), 3)  # [n, 2, 4, 32]
    q = (low | (high << 4)).to(torch.int32).reshape(n, 16, 16) - 32
    dl = (_f16(b, 208) * b[:, 192:208].contiguous().view(torch.int8).float()).unsqueeze(-1)
    return (dl * q.float()).reshape(n, 256)


def _iq4_xs(b: Tensor) -> Tensor:
    n = b.shape[0]
    s_low = torch.stack([b[:, 4:8] & 0x0F, b[:, 4:8] >> 4], dim=-1).reshape(n, 8)
    s_high = _bits(b[:, 2:4], range(0, 8, 2), 3).transpose(-1, -2).reshape(n, 8)  # bits 2s of the uint16
    scales = (s_low | (s_high << 4)).to(torch.int32) - 32
    dl = (_f16(b, 0) * scales.float()).unsqueeze(-1)
    values = _IQ4[_nibbles(b[:, 8:136].reshape(n, 8, 16)).long()]
    return (dl * values).reshape(n, 256)


def _f32(b: Tensor) -> Tensor:
    return b.contiguous().view(torch.float32)


def _f16_values(b: Tensor) -> Tensor:
    return b.contiguous().view(torch.float16).float()


def _bf16(b: Tensor) -> Tensor:
    return b.contiguous().view(torch.bfloat16).float()


@dataclass(frozen=True, slots=True)
class GGMLFormat:
    """One row of the table (module docstring)."""

    name: str
    type_id: int
    block_size: int
    block_bytes: int
    runs: str  # PACKED, DEQUANTIZED or FLOAT
    dequantize_blocks: Callable[[Tensor], Tensor]  # uint8 [n, block_bytes] -> fp32 [n, block_size]

    def row_bytes(self, in_features: int) -> int:
        """Bytes of one row of ``in_features`` weights (a multiple of ``block_size``)."""
        if in_features % self.block_size:
            raise UnsupportedFormatError(f"{self.name} stores rows in blocks of {self.block_size} weights; "
                                         f"a row of {in_features} is not a whole number of blocks")
        return in_features // self.block_size * self.block_bytes

    def dequantize(self, data: Tensor) -> Tensor:
        """fp32 ``[N, K]`` of uint8 ``[N, K / block_size * block_bytes]`` rows in this format."""
        if data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] % self.block_bytes:
            raise ValueError(f"{self.name} rows must be 2-D uint8 of whole {self.block_bytes}-byte blocks; "
                             f"got {tuple(data.shape)} {data.dtype}")
        blocks = data.reshape(-1, self.block_bytes)
        out = torch.empty((blocks.shape[0], self.block_size), dtype=torch.float32)
        for start in range(0, blocks.shape[0], CHUNK_BLOCKS):  # bounded temporaries on a large tensor
            out[start:start + CHUNK_BLOCKS] = self.dequantize_blocks(blocks[start:start + CHUNK_BLOCKS])
        return out.reshape(data.shape[0], -1)


TABLE: tuple[GGMLFormat, ...] = (
    GGMLFormat("F32", 0, 1, 4, FLOAT, _f32),
    GGMLFormat("F16", 1, 1, 2, FLOAT, _f16_values),
    GGMLFormat("Q4_0", 2, 32, 18, PACKED, _q4_0),
    GGMLFormat("Q4_1", 3, 32, 20, PACKED, _q4_1),
    GGMLFormat("Q5_0", 6, 32, 22, PACKED, _q5_0),
    GGMLFormat("Q5_1", 7, 32, 24, PACKED, _q5_1),
    GGMLFormat("Q8_0", 8, 32, 34, PACKED, _q8_0),
    GGMLFormat("Q2_K", 10, 256, 84, PACKED, _q2_k),
    GGMLFormat("Q3_K", 11, 256, 110, PACKED, _q3_k),
    GGMLFormat("Q4_K", 12, 256, 144, PACKED, _q4_k),
    GGMLFormat("Q5_K", 13, 256, 176, PACKED, _q5_k),
    GGMLFormat("Q6_K", 14, 256, 210, PACKED, _q6_k),
    GGMLFormat("IQ4_NL", 20, 32, 18, PACKED, _iq4_nl),
    GGMLFormat("IQ4_XS", 23, 256, 136, PACKED, _iq4_xs),
    GGMLFormat("BF16", 30, 1, 2, FLOAT, _bf16),
    GGMLFormat("MXFP4", 39, 32, 17, PACKED, _mxfp4),
)
BY_NAME = {f.name: f for f in TABLE}
BY_ID = {f.type_id: f for f in TABLE}


def _refuse(what: str) -> UnsupportedFormatError:
    return UnsupportedFormatError(f"tensor format {what} is not supported (supported: {', '.join(BY_NAME)})")


def by_name(name: str) -> GGMLFormat:
    """The format called ``name`` (ggml's spelling, e.g. ``"Q4_K"``); UnsupportedFormatError otherwise."""
    if name not in BY_NAME:
        raise _refuse(repr(name))
    return BY_NAME[name]


def by_id(type_id: int) -> GGMLFormat:
    """The format with ggml type id ``type_id``; UnsupportedFormatError otherwise."""
    if type_id not in BY_ID:
        raise _refuse(f"id {type_id}")
    return BY_ID[type_id]


def packed(type_id: int) -> GGMLFormat:
    """The ``PACKED`` format with id ``type_id`` (one the kernels read); UnsupportedFormatError otherwise."""
    fmt = by_id(type_id)
    if fmt.runs != PACKED:
        raise UnsupportedFormatError(f"{fmt.name} has no quantized kernel (it is {fmt.runs}); packed formats: "
                                     f"{', '.join(f.name for f in TABLE if f.runs == PACKED)}")
    return fmt
