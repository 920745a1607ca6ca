"""Q4_Kr8: Q4_K weights repacked eight rows at a time for the CPU kernel (csrc/cpu/quant_interleaved_k.cpp).

A weight ``[N, K]`` (N a multiple of 8) becomes uint8 ``[N, K / 256 * 148]``: rows 8g..8g+7 hold, per
256-weight block b, one 1184-byte tile (148 bytes a row: the eight GGUF blocks' 1152 plus their 6-bit
scales and mins unpacked to bytes):

- bytes 0..15: the eight rows' fp16 d; 16..31: their fp16 dmin;
- 32..95: scales, byte 32 + 8 j + r = row r's scale of sub-block j; 96..159: mins, the same order;
- 160..1183: 32 chunks of 32 bytes, chunk 8 c + i holding row r's GGUF quant bytes 32 c + 4 i .. + 3 at
  bytes 4 r .. 4 r + 3 (low nibbles: sub-block 2 c, weights 4 i ..; high nibbles: sub-block 2 c + 1).

``interleave_q4_k`` builds it, ``deinterleave_q4_k`` gives the GGUF bytes back exactly.
"""

from __future__ import annotations

import torch

from ops.reference import formats

ROWS = 8
GGUF_BYTES = 144  # a Q4_K block
TILE_BYTES = 1184  # one group's tile per 256-weight block
BLOCK_BYTES = TILE_BYTES // ROWS  # 148: bytes of a row per block in the r8 layout


def interleave_q4_k(qweight: torch.Tensor) -> torch.Tensor:
    """A GGUF-order Q4_K weight ``[N, K / 256 * 144]`` (N a multiple of 8) as Q4_Kr8 ``[N, K / 256 * 148]``."""
    rows = qweight.shape[0]
    if qweight.dim() != 2 or rows % ROWS or qweight.shape[1] % GGUF_BYTES:
        raise ValueError(f"only Q4_K weights of a multiple of {ROWS} rows interleave; got {tuple(qweight.shape)}")
    nb = qweight.shape[1] // GGUF_BYTES
    blocks = qweight.reshape(rows // ROWS, ROWS, nb, GGUF_BYTES).transpose(1, 2)  # [G, nb, 8, 144]
    lead = blocks.shape[:2]
    d, dmin = blocks[..., 0:2].flatten(-2), blocks[..., 2:4].flatten(-2)  # [G, nb, 16] each
    scales, mins = formats._scales_mins_k4(blocks[..., 4:16].reshape(-1, 12))  # [G nb 8, 8]
    scales = scales.reshape(*lead, ROWS, 8).transpose(-1, -2).flatten(-2)  # [G, nb, 64]: sub-block major
    mins = mins.reshape(*lead, ROWS, 8).transpose(-1, -2).flatten(-2)
    quants = blocks[..., 16:].reshape(*lead, ROWS, 32, 4).transpose(-3, -2).flatten(-3)  # [G, nb, 1024]
    tiles = torch.cat([d, dmin, scales, mins, quants], dim=-1)
    return tiles.reshape(rows, nb * BLOCK_BYTES).contiguous()


def deinterleave_q4_k(qweight: torch.Tensor) -> torch.Tensor:
    """The GGUF-order Q4_K weight of a Q4_Kr8 one (``interleave_q4_k``'s inverse)."""
    rows = qweight.shape[0]
    nb = qweight.shape[1] // BLOCK_BYTES
    tiles = qweight.reshape(rows // ROWS, nb, TILE_BYTES)
    lead = tiles.shape[:2]
    d = tiles[..., 0:16].reshape(*lead, ROWS, 2)
    dmin = tiles[..., 16:32].reshape(*lead, ROWS, 2)
    sc = tiles[..., 32:96].reshape(*lead, 8, ROWS).transpose(-1, -2)  # [G, nb, 8 rows, 8 sub-blocks]
    mn = tiles[..., 96:160].reshape(*lead, 8, ROWS).transpose(-1, -2)
    packed = torch.cat([sc[..., :4] | ((sc[..., 4:] >> 4) << 6), mn[..., :4] | ((mn[..., 4:] >> 4) << 6),
                        (sc[..., 4:] & 0x0F) | ((mn[..., 4:] & 0x0F) << 4)], dim=-1)  # [G, nb, 8, 12]
    quants = tiles[..., 160:].reshape(*lead, 32, ROWS, 4).transpose(-3, -2).flatten(-2)  # [G, nb, 8, 128]
    blocks = torch.cat([d, dmin, packed, quants], dim=-1)  # [G, nb, 8, 144]
    return blocks.transpose(1, 2).reshape(rows, nb * GGUF_BYTES).contiguous()


Q6_K_BYTES = 210  # a Q6_K block; its r8 tile is the same bytes reordered (1680 = 8 x 210)


def interleave_q6_k(qweight: torch.Tensor) -> torch.Tensor:
    """A GGUF-order Q6_K weight ``[N, K / 256 * 210]`` (N a multiple of 8) as Q6_Kr8, same shape: per block
    one 1680-byte tile of the eight rows' fp16 d (bytes 0..15), their int8 scales (16..143: byte 16 + 8 i
    + r = row r's scale i), then 32 chunks of 32 bytes of ql (chunk 16 h + 8 p + i: row r's ql bytes 64 h +
    32 p + 4 i..+3 at 4 r), then 16 of qh (chunk 8 h + i: row r's qh bytes 32 h + 4 i..+3 at 4 r)."""
    rows = qweight.shape[0]
    if qweight.dim() != 2 or rows % ROWS or qweight.shape[1] % Q6_K_BYTES:
        raise ValueError(f"only Q6_K weights of a multiple of {ROWS} rows interleave; got {tuple(qweight.shape)}")
    nb = qweight.shape[1] // Q6_K_BYTES
    blocks = qweight.reshape(rows // ROWS, ROWS, nb, Q6_K_BYTES).transpose(1, 2)  # [G, nb, 8, 210]
    lead = blocks.shape[:2]
    d = blocks[..., 208:210].flatten(-2)
    scales = blocks[..., 192:208].transpose(-1, -2).flatten(-2)  # [G, nb, 128]: scale major
    ql = blocks[..., 0:128].reshape(*lead, ROWS, 32, 4).transpose(-3, -2).flatten(-3)
    qh = blocks[..., 128:192].reshape(*lead, ROWS, 16, 4).transpose(-3, -2).flatten(-3)
    return torch.cat([d, scales, ql, qh], dim=-1).reshape(rows, nb * Q6_K_BYTES).contiguous()


def deinterleave_q6_k(qweight: torch.Tensor) -> torch.Tensor:
    """The GGUF-order Q6_K weight of a Q6_Kr8 one (``interleave_q6_k``'s inverse)."""
    rows = qweight.shape[0]
    nb = qweight.shape[1] // Q6_K_BYTES
    tiles = qweight.reshape(rows // ROWS, nb, ROWS * Q6_K_BYTES)
    lead = tiles.shape[:2]
    d = tiles[..., 0:16].reshape(*lead, ROWS, 2)
    scales = tiles[..., 16:144].reshape(*lead, 16, ROWS).transpose(-1, -2)
    ql = tiles[..., 144:1168].reshape(*lead, 32, ROWS, 4).transpose(-3, -2).flatten(-2)
    qh = tiles[..., 1168:1680].reshape(*lead, 16, ROWS, 4).transpose(-3, -2).flatten(-2)
    blocks = torch.cat([ql, qh, scales, d], dim=-1)  # [G, nb, 8, 210]
    return blocks.transpose(1, 2).reshape(rows, nb * Q6_K_BYTES).contiguous()
