"""GGUF block formats in plain torch: the oracle of the quantized-linear kernels.

A quantized weight ``[N, K]`` is stored as uint8 ``[N, K / block_size * block_bytes]``: each row
(one output feature) is blocks of 32 (256 for Q2_K / Q3_K / Q4_K / Q5_K / Q6_K / IQ4_XS) consecutive weights
along K, in ggml's byte layout (the K-quants' in ops/reference/formats.py):

- Q8_0 (34 bytes): fp16 scale d, 32 int8 q; w = d * q.
- Q4_0 (18 bytes): fp16 d, 16 bytes of nibbles; w = d * (q - 8).
- Q4_1 (20 bytes): fp16 d, fp16 m, 16 bytes of nibbles; w = d * q + m.
- Q5_0 (22 bytes): fp16 d, uint32 qh (bit j: element j's fifth bit), nibbles; w = d * (q - 16).
- Q5_1 (24 bytes): fp16 d, fp16 m, qh, nibbles; w = d * q + m.
- IQ4_NL (18 bytes): fp16 d, nibbles indexing a 16-value non-linear int8 table; w = d * v[q].
- MXFP4 (17 bytes): an E8M0 exponent byte e, nibbles indexing the E2M1 values doubled; w = 2^(e - 128) * v[q].

Nibbles: byte j holds element j in its low four bits and element j + 16 in its high four bits.
Format ids, block sizes and the blocks' dequantization are the format table's (ops/reference/formats.py).

Q4_0r8 and Q4_1r8 (ids 1000 + the base id) are the same bytes repacked eight rows at a time for
the CPU kernel (csrc/cpu/quant_interleaved.cpp): the tensor keeps its shape ``[N, row_bytes]``
(N a multiple of 8), and rows 8g..8g+7 hold, per block b, one tile of the eight rows' fp16 d,
then (Q4_1) their fp16 m, then four 32-byte chunks, chunk j holding row r's packed bytes
4j..4j+3 at bytes 4r..4r+3 (``interleave``; ``deinterleave`` undoes it).
Q5_0r8, Q5_1r8 and Q8_0r8 (csrc/cpu/quant_interleaved_q5q8.cpp) likewise: Q8_0's 32 quant bytes
are eight such chunks; a Q5 tile has, between its fp16 fields and its four nibble chunks, eight
32-bit masks, mask c (= 4 half + j) holding at bit 4r + i the fifth bit of row r's weight 4c + i
(chunk j's low nibbles for half 0, high for half 1): the 8 x 8 transpose of the rows' qh nibbles.
Q4_Kr8 (1012) is Q4_K's eight-row layout, a few bytes larger than the GGUF blocks (148 a row per
block: ops/reference/quant_k_r8.py); Q6_Kr8 (1014) reorders Q6_K's bytes eight rows at a time, same size.
"""

from __future__ import annotations

import torch

from ops.reference import formats, quant_k_r8, quantizers

BLOCK = 32
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS = (
    formats.by_name(name).type_id
    for name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"))
MXFP4 = formats.by_name("MXFP4").type_id
K_BLOCKS = (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS)  # 256-weight blocks
INTERLEAVED = 1000  # + the base id: eight rows interleaved
Q4_0R8, Q4_1R8 = INTERLEAVED + Q4_0, INTERLEAVED + Q4_1
Q5_0R8, Q5_1R8, Q8_0R8 = INTERLEAVED + Q5_0, INTERLEAVED + Q5_1, INTERLEAVED + Q8_0
Q4_KR8, Q6_KR8 = INTERLEAVED + Q4_K, INTERLEAVED + Q6_K
R8_BASES = (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0)  # the 32-weight formats with an eight-row layout (Q4_K, Q6_K: quant_k_r8)
BLOCK_BYTES = {f: formats.packed(f % INTERLEAVED).block_bytes
               for f in (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, MXFP4, *K_BLOCKS,
                         *(INTERLEAVED + base for base in R8_BASES), Q6_KR8)}
BLOCK_BYTES[Q4_KR8] = quant_k_r8.BLOCK_BYTES  # scales and mins unpacked: 148 bytes a row per block
ROWS_PER_GROUP = 8


def _scale_bytes(base: int) -> int:
    """Bytes of fp16 fields (d, and m for Q4_1 / Q5_1) at the start of a ``base`` block."""
    return 4 if base in (Q4_1, Q5_1) else 2


def _mask_bytes(base: int) -> int:
    """Bytes of fifth bits (Q5's qh) after a ``base`` block's fp16 fields."""
    return 4 if base in (Q5_0, Q5_1) else 0


def _transpose_nibbles(qh: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., 8, 4]`` read as an 8 x 8 matrix of nibbles (nibble c of row r: bits 4c..4c+3 of
    its little-endian uint32), transposed: row c's nibble r is the input's row r's nibble c."""
    nibbles = torch.stack([qh & 0x0F, qh >> 4], dim=-1).flatten(-2)  # [..., 8 rows, 8 nibbles]
    swapped = nibbles.transpose(-1, -2)
    return swapped[..., 0::2] | (swapped[..., 1::2] << 4)


def interleave(qweight: torch.Tensor, fmt: int) -> torch.Tensor:
    """A Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q6_K weight ``[N, row_bytes]`` (N a multiple of 8) in its r8
    layout, same shape; Q4_K in Q4_Kr8 (``[N, K / 256 * 148]``)."""
    if fmt == Q4_K and qweight.shape[0] % ROWS_PER_GROUP == 0:
        return quant_k_r8.interleave_q4_k(qweight)
    if fmt == Q6_K and qweight.shape[0] % ROWS_PER_GROUP == 0:
        return quant_k_r8.interleave_q6_k(qweight)
    if fmt not in R8_BASES or qweight.shape[0] % ROWS_PER_GROUP:
        raise ValueError(f"only Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q6_K weights of a multiple of "
                         f"{ROWS_PER_GROUP} rows interleave")
    rows, size, head, qh = qweight.shape[0], BLOCK_BYTES[fmt], _scale_bytes(fmt), _mask_bytes(fmt)
    tiles = qweight.reshape(rows // ROWS_PER_GROUP, ROWS_PER_GROUP, -1, size).transpose(1, 2)  # [G, nb, 8, size]
    fields = [tiles[..., i:i + 2].flatten(-2) for i in range(0, head, 2)]  # each [G, nb, 16]
    masks = [_transpose_nibbles(tiles[..., head:head + qh]).flatten(-2)] if qh else []  # [G, nb, 32]
    body = tiles[..., head + qh:]
    quants = body.reshape(*tiles.shape[:3], body.shape[-1] // 4, 4).transpose(2, 3).flatten(-3)  # [G, nb, 8 * q]
    return torch.cat([*fields, *masks, quants], dim=-1).reshape(qweight.shape).contiguous()


def deinterleave(qweight: torch.Tensor, fmt: int) -> torch.Tensor:
    """The GGUF-order weight of an r8 one (``interleave``'s inverse); other formats as they are."""
    if fmt < INTERLEAVED:
        return qweight
    if fmt == Q4_KR8:
        return quant_k_r8.deinterleave_q4_k(qweight)
    if fmt == Q6_KR8:
        return quant_k_r8.deinterleave_q6_k(qweight)
    base = fmt - INTERLEAVED
    rows, size, head, qh = qweight.shape[0], BLOCK_BYTES[base], _scale_bytes(base), _mask_bytes(base)
    tiles = qweight.reshape(rows // ROWS_PER_GROUP, -1, ROWS_PER_GROUP * size)  # [G, nb, 8 * size]
    fields = [tiles[..., i * 8:(i + 2) * 8].reshape(*tiles.shape[:2], ROWS_PER_GROUP, 2) for i in range(0, head, 2)]
    at = head * 8
    masks = []
    if qh:
        masks = [_transpose_nibbles(tiles[..., at:at + 32].reshape(*tiles.shape[:2], ROWS_PER_GROUP, 4))]
        at += 32
    chunks = (size - head - qh) // 4
    quants = tiles[..., at:].reshape(*tiles.shape[:2], chunks, ROWS_PER_GROUP, 4).transpose(2, 3).flatten(-2)
    blocks = torch.cat([*fields, *masks, quants], dim=-1)  # [G, nb, 8, size]
    return blocks.transpose(1, 2).reshape(qweight.shape).contiguous()


def dequantize(qweight: torch.Tensor, fmt: int) -> torch.Tensor:
    """fp32 ``[N, K]`` of a packed uint8 ``[N, K / 32 * block_bytes]`` weight in format ``fmt``."""
    if fmt not in BLOCK_BYTES:
        raise formats.UnsupportedFormatError(f"no packed layout with id {fmt} (ids: {sorted(BLOCK_BYTES)})")
    return formats.packed(fmt % INTERLEAVED).dequantize(deinterleave(qweight, fmt))


def quant_linear(x: torch.Tensor, qweight: torch.Tensor, fmt: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ dequantize(qweight).T + bias`` in fp32 (the weights exactly as stored)."""
    out = x.float() @ dequantize(qweight, fmt).T
    return out if bias is None else out + bias.float()


def quant_linear_bf16(x: torch.Tensor, qweight: torch.Tensor, fmt: int,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ W.T + bias`` with ``x`` and the dequantized weights rounded to bf16 (nearest
    even) and the products summed in fp32: what the AMX kernel computes, up to summation order."""
    out = x.bfloat16().float() @ dequantize(qweight, fmt).bfloat16().float().T
    return out if bias is None else out + bias.float()


def quantize(weight: torch.Tensor, fmt: int) -> torch.Tensor:
    """Pack fp32 ``[N, K]`` (K a multiple of the block size) into ``fmt`` blocks, rounding to nearest
    (for tests and tools; gguf's own quantizer is what the model files use; the K-quants through
    ``ops.reference.quantizers``; MXFP4 by gguf's rule, ``_mxfp4``)."""
    if fmt in (*K_BLOCKS, IQ4_NL):
        return quantizers.quantize(weight.float(), formats.by_id(fmt).name)
    if fmt == MXFP4:
        return _mxfp4(weight.float())
    rows, cols = weight.shape
    w = weight.float().reshape(rows, cols // BLOCK, BLOCK)
    if fmt == Q8_0:
        amax = w.abs().amax(-1, keepdim=True)
        d = (amax / 127).to(torch.float16)
        inv = torch.where(d == 0, 0.0, 1.0 / d.float())
        q = (w * inv).round().clamp(-127, 127).to(torch.int8).view(torch.uint8)
        body = [d.view(torch.uint8).reshape(rows, -1, 2), q]
    elif fmt == Q4_0:
        idx = w.abs().argmax(-1, keepdim=True)
        peak = w.gather(-1, idx)
        d = (peak / -8).to(torch.float16)
        inv = torch.where(d == 0, 0.0, 1.0 / d.float())
        q = (w * inv + 8).round().clamp(0, 15).to(torch.uint8)
        body = [d.view(torch.uint8).reshape(rows, -1, 2), q[..., :16] | (q[..., 16:] << 4)]
    elif fmt == Q4_1:
        lo = w.amin(-1, keepdim=True)
        hi = w.amax(-1, keepdim=True)
        d = ((hi - lo) / 15).to(torch.float16)
        m = lo.to(torch.float16)
        inv = torch.where(d == 0, 0.0, 1.0 / d.float())
        q = ((w - m.float()) * inv).round().clamp(0, 15).to(torch.uint8)
        body = [d.view(torch.uint8).reshape(rows, -1, 2), m.view(torch.uint8).reshape(rows, -1, 2),
                q[..., :16] | (q[..., 16:] << 4)]
    elif fmt == Q5_0:
        idx = w.abs().argmax(-1, keepdim=True)
        d = (w.gather(-1, idx) / -16).to(torch.float16)
        inv = torch.where(d == 0, 0.0, 1.0 / d.float())
        q = (w * inv + 16).round().clamp(0, 31).to(torch.uint8)
        body = [d.view(torch.uint8).reshape(rows, -1, 2), _fifth_bits(q),
                (q[..., :16] & 0x0F) | ((q[..., 16:] & 0x0F) << 4)]
    elif fmt == Q5_1:
        lo = w.amin(-1, keepdim=True)
        d = ((w.amax(-1, keepdim=True) - lo) / 31).to(torch.float16)
        m = lo.to(torch.float16)
        inv = torch.where(d == 0, 0.0, 1.0 / d.float())
        q = ((w - m.float()) * inv).round().clamp(0, 31).to(torch.uint8)
        body = [d.view(torch.uint8).reshape(rows, -1, 2), m.view(torch.uint8).reshape(rows, -1, 2), _fifth_bits(q),
                (q[..., :16] & 0x0F) | ((q[..., 16:] & 0x0F) << 4)]
    else:
        packs = sorted(f for f in BLOCK_BYTES if f < INTERLEAVED)
        raise formats.UnsupportedFormatError(f"quantize packs {', '.join(formats.by_id(f).name for f in packs)} "
                                             f"(ids {packs}); got id {fmt}")
    return torch.cat(body, dim=-1).reshape(rows, -1)


def _mxfp4(weight: torch.Tensor) -> torch.Tensor:
    """MXFP4 blocks of fp32 ``[N, K]`` by gguf's rule: exponent byte floor(log2(max|w|)) - 2 + 127
    (0 for an all-zero block; clamped to a byte), each weight the nearest of d v (the first on a tie)."""
    rows, cols = weight.shape
    w = weight.reshape(rows, cols // BLOCK, BLOCK)
    amax = w.abs().amax(-1, keepdim=True)
    exponent = torch.frexp(amax).exponent - 1 + 125  # floor(log2(amax)) - 2 + 127, exactly
    e = torch.where(amax > 0, exponent, 0).clamp(0, 255).to(torch.uint8)
    values = torch.tensor(formats.MXFP4_VALUES, dtype=torch.float32)
    grid = formats.e8m0_half(e).unsqueeze(-1) * values  # [N, nb, 1, 16]
    q = (grid - w.unsqueeze(-1)).abs().argmin(-1).to(torch.uint8)  # [N, nb, 32]
    return torch.cat([e, q[..., :16] | (q[..., 16:] << 4)], dim=-1).reshape(rows, -1)


def _fifth_bits(q: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., 4]``: the little-endian uint32 whose bit j is bit 4 of ``q[..., j]`` (``[..., 32]``)."""
    bits = (q >> 4).reshape(*q.shape[:-1], 4, 8).to(torch.int32) << torch.arange(8, dtype=torch.int32)
    return bits.sum(-1).to(torch.uint8)


def int8_activations(x: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """``x [M, K]`` as the int8-activation kernel sees it: per 32-block ``d * round(x / d)`` with
    ``d = max|x| / 127`` (the kernel's only rounding besides fp32 sums). ``block``: another block size
    (K a multiple of it)."""
    blocks = x.float().reshape(x.shape[0], -1, block)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1.0 / d, 0.0)
    return (torch.round(blocks * inv) * d).reshape(x.shape)


def screened_argmax(approx: torch.Tensor, hidden: torch.Tensor, qweight: torch.Tensor, fmt: int,
                    norms: torch.Tensor, rounding: float, norm_slack: float,
                    row_scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens, candidates)`` int64 ``[rows]`` of the int8-activation screen of a quantized lm_head:
    per row the first maximum of the fp32-activation logits among the tokens whose ``approx`` (the
    int8-activation logits) plus ``(norm_slack |x_hat - x| + rounding |x|) norms`` reaches the row's
    largest ``approx - `` that bound; -1 where the row has a non-finite value. ``row_scales [rows]``
    replaces the factor before ``norms`` (another screen's bound)."""
    hidden = hidden.float()
    if row_scales is not None:
        scale = row_scales.float().reshape(-1, 1)
    else:
        error = (int8_activations(hidden).double() - hidden.double()).norm(dim=1, keepdim=True)
        scale = (norm_slack * error + rounding * hidden.double().norm(dim=1, keepdim=True)).float()
    slack = scale * norms
    floor = (approx - slack).max(dim=1, keepdim=True).values
    mask = approx + slack >= floor
    finite = torch.isfinite(approx).all(dim=1) & torch.isfinite(floor).squeeze(1) & torch.isfinite(scale).squeeze(1)
    unscreened = ~finite
    weight = dequantize(qweight, fmt)
    exact = (hidden @ weight.T).masked_fill(~mask, float("-inf"))
    tokens = exact.max(dim=-1).indices.masked_fill(unscreened, -1)
    return tokens, mask.sum(dim=1).masked_fill(unscreened, 0)
