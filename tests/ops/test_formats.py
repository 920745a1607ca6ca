"""The format table (ops/reference/formats.py): ids and sizes are ggml's (the `gguf` package's and
csrc/cpu/ops.h's), every dequantizer gives gguf's reference bits over random blocks (every scale
and min value, every fp16 scale class), unknown formats are refused by name, and the reference
quantizers write blocks that decode (by gguf too) to close to what they were given."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

import ops
from ops.quant import FORMATS
from ops.reference import formats, quantizers
from ops.reference import quant as ref

gguf = pytest.importorskip("gguf")
HEADER = Path(__file__).resolve().parents[2] / "csrc" / "cpu" / "ops.h"
QUANTIZED = [f for f in formats.TABLE if f.runs != formats.FLOAT]
# byte offsets of each format's fp16 scale fields (d, m / dmin)
SCALES = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "IQ4_NL": (0,),
          "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_XS": (0,),
          "MXFP4": ()}  # MXFP4's scale is its E8M0 byte 0: every value is a valid exponent (_random_blocks)


def test_table_ids_and_sizes_are_ggmls() -> None:
    for fmt in formats.TABLE:
        qtype = gguf.GGMLQuantizationType[fmt.name]
        assert fmt.type_id == qtype.value
        assert (fmt.block_size, fmt.block_bytes) == gguf.GGML_QUANT_SIZES[qtype]
    packed = {f.name for f in formats.TABLE if f.runs == formats.PACKED}
    assert packed == {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "MXFP4", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
                      "IQ4_XS"}
    assert set(SCALES) == {f.name for f in QUANTIZED}


def test_cpp_format_ids_equal_the_table() -> None:
    """csrc/cpu/ops.h names the packed formats the kernels take; its ids are the table's, and the
    eight-row layouts are the reference's (1000 + the base id)."""
    ids = {m[1]: int(m[2]) if m[2].isdigit() else m[2]
           for m in re.finditer(r"constexpr int64_t kQuant(\w+) = ([^;]+);", HEADER.read_text())}
    assert ids.pop("Interleaved") == ref.INTERLEAVED
    for r8 in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q6_K"):
        assert ids.pop(f"{r8}R8") == f"kQuantInterleaved + kQuant{r8}"
    assert ids == {f.name: f.type_id for f in formats.TABLE if f.runs == formats.PACKED}
    assert (ids["Q4_0"], ids["Q4_1"], ids["Q5_0"], ids["Q5_1"], ids["Q8_0"]) == (ref.Q4_0, ref.Q4_1, ref.Q5_0, ref.Q5_1,
                                                                             ref.Q8_0)


def _finite_fp16(rng: np.random.Generator, count: int) -> np.ndarray:
    """``count`` fp16 bit patterns over every finite class (zero, subnormal, normal, both signs)."""
    bits = rng.integers(0, 1 << 16, count, dtype=np.uint16)
    bits[(bits & 0x7C00) == 0x7C00] &= 0x83FF  # inf / NaN exponent -> subnormal
    bits[:4] = (0x0000, 0x8000, 0x0001, 0x3C00)  # +0, -0, the smallest subnormal, 1.0
    return bits


def _random_blocks(fmt: formats.GGMLFormat, count: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (count, fmt.block_bytes), dtype=np.uint8)
    for offset in SCALES[fmt.name]:
        raw[:, offset:offset + 2] = _finite_fp16(rng, count).view(np.uint8).reshape(count, 2)
    if fmt.name == "MXFP4":  # every E8M0 exponent at least once: subnormal (0, 1) to 2^127 (255)
        raw[:256, 0] = np.arange(256, dtype=np.uint8)
    return raw


@pytest.mark.parametrize("fmt", QUANTIZED, ids=lambda f: f.name)
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # MXFP4's 12 * 2^127 is inf
def test_dequantize_equals_gguf_reference(fmt: formats.GGMLFormat) -> None:
    raw = _random_blocks(fmt, 4096, seed=fmt.type_id)
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[fmt.name]).reshape(4096, fmt.block_size)
    got = fmt.dequantize(torch.from_numpy(raw)).numpy()
    np.testing.assert_array_equal(got, expected)
    rows = fmt.dequantize(torch.from_numpy(raw.reshape(64, -1))).numpy()  # rows of many blocks
    np.testing.assert_array_equal(rows, expected.reshape(64, -1))
    if fmt.runs == formats.PACKED:  # the oracle, and the kernels' dequantization (every fp16 scale class)
        np.testing.assert_array_equal(ref.dequantize(torch.from_numpy(raw.reshape(64, -1)), fmt.type_id).numpy(),
                                      expected.reshape(64, -1))
        np.testing.assert_array_equal(ops.dequantize(torch.from_numpy(raw.reshape(64, -1)), FORMATS[fmt.name]).numpy(),
                                      expected.reshape(64, -1))


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_mxfp4_every_exponent_and_code_bit_for_bit() -> None:
    """MXFP4: each of the 256 E8M0 exponents with each of the 16 codes at every position, the bits of
    gguf's reference (ggml's half scale: 2^(e - 128), subnormal for e < 2, e = 255 finite 2^127, so
    12 x 2^127 is inf; code 8 is +0, not -0), in the table, the oracle and the C++ kernels."""
    fmt = formats.by_name("MXFP4")
    codes = np.arange(16, dtype=np.uint8)
    nibbles = np.stack([np.roll(codes, s) for s in range(32)])  # [32 variants, 16]: every code at every position
    quants = (nibbles[:, :16] | (np.roll(nibbles, 8, axis=1)[:, :16] << 4)).astype(np.uint8)
    raw = np.concatenate([np.repeat(np.arange(256, dtype=np.uint8), 32)[:, None], np.tile(quants, (256, 1))], axis=1)
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.MXFP4).reshape(-1, 32)
    assert np.isinf(expected).any() and (expected[expected != 0] != 0).all()
    assert not np.signbit(expected[expected == 0]).any()
    scales = expected[::32, 1]  # code 1 (value 1) at position 1 of each exponent's first block: d itself
    assert scales[0] == np.float32(2.0 ** -128) and scales[128] == 1.0 and scales[255] == np.float32(2.0 ** 127)
    assert (scales[1:] == 2 * scales[:-1]).all()
    rows = torch.from_numpy(raw.reshape(256, -1))
    for got in (fmt.dequantize(torch.from_numpy(raw)), ref.dequantize(rows, fmt.type_id),
                ops.dequantize(rows, FORMATS["MXFP4"])):
        np.testing.assert_array_equal(got.numpy().reshape(-1, 32).view(np.uint32), expected.view(np.uint32))


@pytest.mark.parametrize("name", ["Q4_K", "Q5_K"])
def test_random_blocks_cover_every_scale_and_min(name: str) -> None:
    """The 6-bit packed scales and mins of Q4_K / Q5_K: the random blocks above hold every value at
    every sub-block position (so the bit-equality covers them all)."""
    fmt = formats.by_name(name)
    scales, mins = formats._scales_mins_k4(torch.from_numpy(_random_blocks(fmt, 4096, fmt.type_id))[:, 4:16])
    for field in (scales, mins):
        for j in range(8):
            assert torch.unique(field[:, j]).tolist() == list(range(64))


def test_random_blocks_cover_every_q2_k_scale_and_min() -> None:
    """Q2_K's 4-bit scales (low nibbles) and mins (high nibbles), one pair per 16 weights: the random
    blocks hold every value of both at every position, each beside a zero and a non-zero partner."""
    raw = torch.from_numpy(_random_blocks(formats.by_name("Q2_K"), 4096, formats.by_name("Q2_K").type_id))
    scales, mins = raw[:, :16] & 0x0F, raw[:, :16] >> 4
    for i in range(16):
        for field, other in ((scales, mins), (mins, scales)):
            assert torch.unique(field[:, i]).tolist() == list(range(16))
            for v in range(16):
                partners = other[field[:, i] == v, i]
                assert (partners == 0).any() and (partners != 0).any(), (i, v)


@pytest.mark.parametrize("name", ["F32", "F16", "BF16"])
def test_float_formats(name: str) -> None:
    values = torch.randn(6, 8)
    dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[name]
    stored = values.to(dtype)
    raw = stored.contiguous().view(torch.uint8).reshape(6, -1)
    assert torch.equal(formats.by_name(name).dequantize(raw), stored.float())


def test_unknown_formats_are_refused_by_name() -> None:
    known = {f.name for f in formats.TABLE}
    for qtype in gguf.GGMLQuantizationType:
        if qtype.name not in known:
            with pytest.raises(formats.UnsupportedFormatError, match=f"{qtype.name}.*not supported"):
                formats.by_name(qtype.name)
            with pytest.raises(formats.UnsupportedFormatError, match=f"id {qtype.value} is not supported"):
                formats.by_id(qtype.value)
    with pytest.raises(formats.UnsupportedFormatError, match="F16 has no quantized kernel"):
        formats.packed(formats.by_name("F16").type_id)
    with pytest.raises(formats.UnsupportedFormatError, match="no packed layout with id 1 "):
        ref.dequantize(torch.zeros(1, 2, dtype=torch.uint8), 1)
    with pytest.raises(formats.UnsupportedFormatError, match=r"got id 1$"):
        ref.quantize(torch.zeros(1, 256), 1)
    with pytest.raises(formats.UnsupportedFormatError, match="blocks of 256 weights"):
        formats.by_name("Q6_K").row_bytes(576)


# relative Frobenius error of the round-to-nearest quantizers on Gaussian weights (measured: 0.33,
# 0.20, 0.080, 0.039, 0.021, 0.082, 0.083), each bound a little above
ERROR = {"Q2_K": 0.36, "Q3_K": 0.23, "Q4_K": 0.09, "Q5_K": 0.045, "Q6_K": 0.025, "IQ4_NL": 0.09, "IQ4_XS": 0.09}


@pytest.mark.parametrize("name", sorted(quantizers.QUANTIZERS))
def test_reference_quantizers_write_valid_blocks(name: str) -> None:
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(16, 512, generator=gen) * 0.05
    weight[3, 7] = 0.9  # an outlier: one coarse block
    weight[5, :256] = 0.0  # an all-zero super-block: zero scales
    packed = quantizers.quantize(weight, name)
    fmt = formats.by_name(name)
    assert packed.dtype == torch.uint8 and packed.shape == (16, fmt.row_bytes(512))
    ours = fmt.dequantize(packed)
    theirs = gguf.quants.dequantize(packed.numpy(), gguf.GGMLQuantizationType[name])
    np.testing.assert_array_equal(ours.numpy(), theirs)
    assert torch.isfinite(ours).all() and torch.equal(ours[5, :256], torch.zeros(256))
    assert ((ours - weight).norm() / weight.norm()).item() < ERROR[name]
    again = quantizers.quantize(ours, name)  # decoded weights are (nearly) fixed points
    assert ((fmt.dequantize(again) - ours).norm() / ours.norm()).item() < ERROR[name] / 2
    with pytest.raises(formats.UnsupportedFormatError, match="no reference quantizer for Q8_0"):
        quantizers.quantize(weight, "Q8_0")


def test_dequantize_in_chunks_equals_one_pass() -> None:
    """A tensor of more than `CHUNK_BLOCKS` blocks is dequantized chunk by chunk: same values."""
    fmt = formats.by_name("Q4_K")
    raw = torch.from_numpy(_random_blocks(fmt, formats.CHUNK_BLOCKS + 48, seed=3))
    assert torch.equal(fmt.dequantize(raw.reshape(-1, 8 * fmt.block_bytes)).reshape(-1, 256),
                       fmt.dequantize_blocks(raw))
