"""ops.quant: GGUF block formats against gguf's own dequantizer, and the C++ quantized linear
against the torch reference over a grid of shapes, formats, row counts and biases."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import ops
from ops.quant import FORMATS, INTERLEAVED, Q4_0, Q4_1, Q4_1R8, Q8_0, QUANT_GEMV_MAX_ROWS, QuantFormat, interleave
from ops.reference import quant as ref
from tests.ops.per_row_checks import fixed_gemm_linear, per_row_bits_match_alone

gguf = pytest.importorskip("gguf")
GGML = {name: gguf.GGMLQuantizationType[name] for name in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "MXFP4")}
# IQ4_NL: our reference quantizer (ops.reference.quantizers)
GGUF_QUANTIZES = {"Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "MXFP4"}
SHAPES = [(576, 576), (192, 576), (576, 1536), (1536, 576), (32, 32), (96, 160)]  # (N, K)
ROWS = [1, 2, 3, 4, 7, 16, 64, 130]
# The 32-weight-block formats (the K-quants' grid is tests/ops/test_kquant_linear.py).
BLOCK32 = {name: fmt for name, fmt in FORMATS.items() if fmt.block_size == 32}
# The kernel's layouts: GGUF order, and the 32-weight affine formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) repacked eight
# rows at a time (the r8 K-quants' grid is tests/ops/test_kquant_linear.py's).
R8 = {base: r8 for base, r8 in INTERLEAVED.items() if base.block_size == 32}
LAYOUTS = {**BLOCK32, **{r8.name: r8 for r8 in R8.values()}}
BASE = {r8.name: base for base, r8 in R8.items()}


def _packed(fmt: QuantFormat, n: int, k: int, seed: int) -> tuple[torch.Tensor, np.ndarray]:
    rng = np.random.default_rng(seed)
    weight = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    if fmt.name not in GGUF_QUANTIZES:
        packed = ref.quantize(torch.from_numpy(weight), fmt.type_id)
        return packed, packed.numpy()
    data = gguf.quants.quantize(weight, GGML[fmt.name])
    return torch.from_numpy(np.ascontiguousarray(data)), data


def _laid_out(name: str, n: int, k: int, seed: int) -> tuple[torch.Tensor, QuantFormat]:
    """A gguf-quantized weight in layout `name` (an r8 one: its base format, interleaved)."""
    if name not in BASE:
        return _packed(FORMATS[name], n, k, seed)[0], FORMATS[name]
    packed, fmt = interleave(_packed(BASE[name], n, k, seed)[0], BASE[name])
    assert fmt.name == name
    return packed, fmt


@pytest.mark.parametrize("base", sorted(R8, key=lambda f: f.name), ids=lambda f: f.name)
def test_interleaved_layout_keeps_every_byte(base: QuantFormat) -> None:
    """The r8 layout is a permutation of the GGUF bytes (Q5: of their bits): it dequantizes (kernel and reference) to
    the same weights, undoes exactly, keeps the shape; other formats and row counts stay as given."""
    packed, _ = _packed(base, 48, 96, 9)
    r8, fmt = interleave(packed, base)
    assert fmt == INTERLEAVED[base] and r8.shape == packed.shape and not torch.equal(r8, packed)
    if base.name in ("Q5_0", "Q5_1"):  # the fifth bits move between bytes (a transpose of the qh nibbles)
        bits = torch.arange(8, dtype=torch.uint8)
        assert torch.equal(((r8.unsqueeze(-1) >> bits) & 1).sum(), ((packed.unsqueeze(-1) >> bits) & 1).sum())
    else:
        assert torch.equal(torch.sort(r8.flatten()).values, torch.sort(packed.flatten()).values)
    assert torch.equal(ref.deinterleave(r8, fmt.type_id), packed)
    weight = ref.dequantize(packed, base.type_id)
    assert torch.equal(ref.dequantize(r8, fmt.type_id), weight)
    assert torch.equal(ops.dequantize(r8, fmt), weight)
    odd, _ = _packed(base, 44, 96, 9)
    assert interleave(odd, base) == (odd, base)  # not a multiple of 8 rows: GGUF order
    table, _ = _packed(FORMATS["IQ4_NL"], 48, 96, 9)
    assert interleave(table, FORMATS["IQ4_NL"])[1] == FORMATS["IQ4_NL"]  # no r8 layout
    with pytest.raises(ValueError, match="multiple of 8 rows"):
        ops.quant_linear(torch.randn(1, 96), r8[:44], fmt)


@pytest.mark.parametrize("name", sorted(BLOCK32))
def test_reference_matches_gguf_dequantize(name: str) -> None:
    fmt = FORMATS[name]
    rng = np.random.default_rng(1)
    raw = rng.integers(0, 256, (24, 4 * fmt.block_bytes), dtype=np.uint8)  # random blocks: every nibble
    for b in range(4):  # keep the fp16 scales finite and moderate
        off = b * fmt.block_bytes
        if name == "MXFP4":  # its E8M0 exponent byte: 2^-28 .. 2^11 (every exponent: tests/ops/test_formats.py)
            raw[:, off] = rng.integers(100, 140, 24)
            continue
        raw[:, off:off + 2] = np.float16(rng.uniform(-0.1, 0.1, (24, 1))).view(np.uint8)
        if name in ("Q4_1", "Q5_1"):
            raw[:, off + 2:off + 4] = np.float16(rng.uniform(-1, 1, (24, 1))).view(np.uint8)
    expected = gguf.quants.dequantize(raw, GGML[name])
    got = ref.dequantize(torch.from_numpy(raw), fmt.type_id).numpy()
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(ops.dequantize(torch.from_numpy(raw), fmt).numpy(), expected)


@pytest.mark.parametrize("name", sorted(GGUF_QUANTIZES))
def test_reference_quantize_round_trips_like_gguf(name: str) -> None:
    fmt = FORMATS[name]
    packed, data = _packed(fmt, 64, 128, 2)
    ours = ref.quantize(torch.from_numpy(gguf.quants.dequantize(data, GGML[name])), fmt.type_id)
    # Requantizing gguf's own output reproduces its weights (up to ties in the scale search).
    np.testing.assert_allclose(ref.dequantize(ours, fmt.type_id).numpy(), ref.dequantize(packed, fmt.type_id).numpy(),
                               atol=2e-3)


def test_reference_mxfp4_quantizer_is_ggufs() -> None:
    """`ref.quantize` to MXFP4 writes gguf's blocks bit for bit (its exponent rule and nearest code),
    all-zero blocks and an outlier included."""
    weight = torch.randn(24, 256, generator=torch.Generator().manual_seed(3)) * 0.05
    weight[2, :32] = 0.0
    weight[5, 40] = 3.0
    ours = ref.quantize(weight, ref.MXFP4)
    np.testing.assert_array_equal(ours.numpy(), gguf.quants.quantize(weight.numpy(), GGML["MXFP4"]))
    assert (ref.dequantize(ours, ref.MXFP4) - weight).norm() < 0.15 * weight.norm()


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("m", ROWS)
def test_kernel_matches_reference(m: int, name: str, n: int, k: int, with_bias: bool) -> None:
    qweight, fmt = _laid_out(name, n, k, m + n + k)
    gen = torch.Generator().manual_seed(m * 7 + n)
    x = torch.randn(m, k, generator=gen)
    bias = torch.randn(n, generator=gen) if with_bias else None
    exact = ref.quant_linear(x, qweight, fmt.type_id, bias)
    if m > QUANT_GEMV_MAX_ROWS and name not in BASE:  # dequantize + oneDNN: the stored weights, exactly
        torch.testing.assert_close(ops.quant_linear(x, qweight, fmt, bias), exact, rtol=1e-4, atol=1e-4)
        return
    # int8 activations: exactly the reference on the int8-rounded activations...
    as_int8 = ref.quant_linear(ref.int8_activations(x), qweight, fmt.type_id, bias)
    got = ops.quant_linear(x, qweight, fmt, bias)
    torch.testing.assert_close(got, as_int8, rtol=1e-4, atol=1e-4)
    # ...which is within ~1% (of the output's scale) of the fp32 product.
    assert (got - exact).abs().max() <= 0.02 * exact.abs().max() + 1e-4
    fp32 = ops.quant_linear(x, qweight, fmt, bias, int8_activations=False)
    torch.testing.assert_close(fp32, exact, rtol=1e-4, atol=1e-4)


def test_leading_dims_strided_and_empty() -> None:
    qweight, _ = _packed(Q4_1, 40, 64, 3)
    x = torch.randn(2, 3, 128)[..., ::2]
    out = ops.quant_linear(x, qweight, Q4_1, int8_activations=False)
    assert out.shape == (2, 3, 40)
    torch.testing.assert_close(out, ref.quant_linear(x.reshape(6, 64), qweight, Q4_1.type_id).view(2, 3, 40),
                               rtol=1e-4, atol=1e-4)
    assert ops.quant_linear(torch.randn(0, 64), qweight, Q4_1).shape == (0, 40)


def test_reference_backend() -> None:
    qweight, _ = _packed(Q4_1, 40, 64, 4)
    x = torch.randn(2, 64)
    out = ops.quant_linear(x, qweight, Q4_1, policy=ops.REFERENCE)
    torch.testing.assert_close(out, ref.quant_linear(x, qweight, Q4_1.type_id))


def test_bad_arguments_raise() -> None:
    qweight, _ = _packed(Q4_1, 40, 64, 5)
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="unsupported quantization format 'IQ2_XXS'"):
        ops.quant_format("IQ2_XXS")
    with pytest.raises(ValueError, match="QuantFormat"):
        ops.quant_linear(x, qweight, 3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="bytes; Q8_0 with K=64 needs 68"):
        ops.quant_linear(x, qweight, FORMATS["Q8_0"])
    with pytest.raises(ValueError, match="multiple of 32"):
        ops.quant_linear(torch.randn(2, 40), qweight, Q4_1)
    with pytest.raises(ValueError, match="uint8"):
        ops.quant_linear(x, qweight.to(torch.int8), Q4_1)
    with pytest.raises(ValueError, match="fp32"):
        ops.quant_linear(x.half(), qweight, Q4_1)
    with pytest.raises(ValueError, match="bias"):
        ops.quant_linear(x, qweight, Q4_1, torch.randn(41))


@pytest.mark.parametrize("m", [1, 4, 16, QUANT_GEMV_MAX_ROWS + 2])
def test_openmp_rows_change_threads_not_bits(m: int) -> None:
    """`ops.parallel.set_openmp_rows` changes which threads run the chunks (OpenMP's or the chunk
    pool's), never what a chunk computes: bit-identical outputs either way, at two threads."""
    from ops.parallel import openmp_rows, set_openmp_rows

    qweight, _ = _packed(Q4_1, 1536, 576, m)
    r8, _ = interleave(qweight, Q4_1)
    x = torch.randn(m, 576, generator=torch.Generator().manual_seed(m))
    threads, rows = torch.get_num_threads(), openmp_rows()
    torch.set_num_threads(2)

    def outputs() -> list[torch.Tensor]:
        return [ops.quant_linear(x, qweight, Q4_1), ops.dequantize(qweight, Q4_1), ops.quant_linear(x, r8, Q4_1R8),
                ops.dequantize(r8, Q4_1R8)]

    try:
        set_openmp_rows(1)  # every kernel on OpenMP
        expected = outputs()
        set_openmp_rows(1 << 40)  # every kernel on the chunk pool
        got = outputs()
    finally:
        set_openmp_rows(rows)
        torch.set_num_threads(threads)
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)


TILE_ROWS = [*range(1, 10), 15, 16, 17, 31, 32, 33, QUANT_GEMV_MAX_ROWS, QUANT_GEMV_MAX_ROWS + 1]


@pytest.mark.parametrize(("n", "k"), [(37, 160), (96, 32), (130, 1536), (136, 96)])
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_kernel_tiles_every_row_count(name: str, n: int, k: int) -> None:
    """Every row count the kernel splits into tiles (4 rows per pass, 5 when five are left), N and K
    off the tile and odd in blocks, bias on every other count: int8 activations equal the reference on the rounded
    activations, fp32 activations the reference itself, and a row's output is bit for bit the same
    in any batch (the last row, in the last partial tile, against that row alone). An r8 layout
    takes weights of a multiple of 8 rows only (N = 37 and 130 stay in GGUF order); its int8 rows
    stay on the kernel past `QUANT_GEMV_MAX_ROWS` too, GGUF order's go to oneDNN in fp32."""
    if name in BASE and n % 8:
        pytest.skip("an interleaved weight has a multiple of 8 rows")
    qweight, fmt = _laid_out(name, n, k, n * k)
    weight = ref.dequantize(qweight, fmt.type_id)
    gen = torch.Generator().manual_seed(n + k)
    x = torch.randn(max(TILE_ROWS), k, generator=gen)
    x[:, 3] *= 20  # an outlier in the first block of every row
    bias = torch.randn(n, generator=gen)
    for i, m in enumerate(TILE_ROWS):
        b = bias if i % 2 else None
        rows = x[:m]
        expected = rows @ weight.T + (0 if b is None else b)
        if m <= QUANT_GEMV_MAX_ROWS or name in BASE:
            as_int8 = ref.int8_activations(rows) @ weight.T + (0 if b is None else b)
            got = ops.quant_linear(rows, qweight, fmt, b)
            torch.testing.assert_close(got, as_int8, rtol=1e-4, atol=1e-4)
            assert torch.equal(got[-1:], ops.quant_linear(rows[-1:], qweight, fmt, b))
            if m <= 9:  # the small batches of a speculative verify row (1 + k rows): every row
                for j in range(m - 1):
                    assert torch.equal(got[j:j + 1], ops.quant_linear(rows[j:j + 1], qweight, fmt, b)), (m, j)
        fp32 = ops.quant_linear(rows, qweight, fmt, b, int8_activations=False)
        torch.testing.assert_close(fp32, expected, rtol=1e-4, atol=1e-4)
        if m <= QUANT_GEMV_MAX_ROWS:
            assert torch.equal(fp32[-1:], ops.quant_linear(rows[-1:], qweight, fmt, b, int8_activations=False))


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize(("m", "exact"), [(1, 1), (5, 2), (9, 8), (40, 37), (QUANT_GEMV_MAX_ROWS, 3)])
def test_exact_rows_keep_fp32_activations(name: str, m: int, exact: int) -> None:
    """`exact_rows` (a step's prompt tokens): those leading rows are bit for bit the fp32-activation
    output, the others the int8-activation output, of the same rows computed alone."""
    _check_exact_rows(name, m, exact)


@pytest.mark.parametrize("name", sorted(BASE))
@pytest.mark.parametrize("exact", [0, 3, QUANT_GEMV_MAX_ROWS + 5])
def test_r8_int8_rows_stay_on_the_kernel_past_the_crossover(name: str, exact: int) -> None:
    """Past `QUANT_GEMV_MAX_ROWS` rows the r8 layouts keep their int8 rows on the kernel (its fp32
    rows go to oneDNN once there are more of them than that): the same split holds bit for bit.
    GGUF order runs such a step on oneDNN in fp32, every row."""
    _check_exact_rows(name, QUANT_GEMV_MAX_ROWS + 20, exact)


def _check_exact_rows(name: str, m: int, exact: int) -> None:
    qweight, fmt = _laid_out(name, 64, 160, m)
    gen = torch.Generator().manual_seed(m + exact)
    x = torch.randn(m, 160, generator=gen)
    bias = torch.randn(64, generator=gen)
    got = ops.quant_linear(x, qweight, fmt, bias, exact_rows=exact)
    assert torch.equal(got[:exact], ops.quant_linear(x[:exact], qweight, fmt, bias, int8_activations=False))
    assert torch.equal(got[exact:], ops.quant_linear(x[exact:], qweight, fmt, bias))
    if exact < m:  # an int8 row is the same alone (one row: the kernel) as in a step of any size
        assert torch.equal(got[-1:], ops.quant_linear(x[-1:], qweight, fmt, bias))
    assert torch.equal(ops.quant_linear(x, qweight, fmt, bias, False, exact_rows=exact),
                       ops.quant_linear(x, qweight, fmt, bias, False))  # fp32 activations: every row already


@pytest.mark.parametrize("name", sorted(BASE))
@pytest.mark.parametrize("m", [1, 3, 4, 5, 9, 16, 21, 40])
@pytest.mark.parametrize("with_bias", [False, True])
def test_r8_groups_in_pairs_equal_groups_alone(name: str, m: int, with_bias: bool) -> None:
    """Where the CPU has AVX-512 VNNI, two eight-row groups share one 512-bit pass; a weight of one
    group (8 rows) always takes the single-group pass. Every group of a wide weight (an odd count,
    so one is left over) gives bit for bit what that group alone gives: the path never shows."""
    n, k = 8 * 7, 576
    packed, fmt = _laid_out(name, n, k, 23)
    rows = packed.shape[1]
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    bias = torch.randn(n) if with_bias else None
    whole = ops.quant_linear(x, packed, fmt, bias)
    for g in range(n // 8):
        group = packed.view(-1)[g * 8 * rows:(g + 1) * 8 * rows].view(8, rows)  # r8 groups are contiguous
        alone = ops.quant_linear(x, group, fmt, None if bias is None else bias[8 * g:8 * g + 8])
        assert torch.equal(whole[:, 8 * g:8 * g + 8], alone), g


@pytest.mark.parametrize("fmt", [Q4_0, Q4_1, FORMATS["Q5_0"], FORMATS["Q5_1"], Q8_0, FORMATS["IQ4_NL"],
                                 FORMATS["MXFP4"]], ids=lambda f: f.name)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize(("n", "k"), [(24, 64), (200, 96), (72, 576)])
def test_quant_fixed_gemm_is_fixed_gemm_on_the_dequantized_weight(fmt: QuantFormat, interleaved: bool, n: int,
                                                                  k: int) -> None:
    """`quant_fixed_gemm` equals `ops.linear(..., fixed=pack_fixed(dequantize(W)))` bit for bit at
    every row count (the exact rows' arithmetic in deterministic mode), odd N included."""
    g = torch.Generator().manual_seed(n + k)
    qweight = ref.quantize(torch.randn(n, k, generator=g), fmt.type_id)
    if interleaved:
        qweight, fmt = ops.quant.interleave(qweight, fmt)
    weight = ops.quant.dequantize(qweight, fmt, k)
    bias = torch.randn(n, generator=g)
    x = torch.randn(37, k, generator=g)
    for rows in (1, 5, 37):
        got = fixed_gemm_linear(x[:rows], qweight, fmt, bias)
        assert torch.equal(got, ops.linear(x[:rows], weight, bias, fixed=ops.pack_fixed(weight))), rows
        assert torch.equal(got, fixed_gemm_linear(x, qweight, fmt, bias)[:rows]), rows


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize(("m", "exact"), [(1, 0), (1, 1), (40, 7), (QUANT_GEMV_MAX_ROWS + 40, 0),
                                          (QUANT_GEMV_MAX_ROWS + 40, QUANT_GEMV_MAX_ROWS + 10)])
def test_per_row_entry_keeps_every_count_on_the_kernel(name: str, m: int, exact: int) -> None:
    """`quant_linear(..., per_row=True)` (a MoE expert's grouped rows): at any count, past the oneDNN crossover
    too, each row is bit for bit what it is alone (its leading `exact` rows on fp32 activations), and
    close to the reference."""
    qweight, fmt = _laid_out(name, 64, 160, m)
    x = torch.randn(m, 160, generator=torch.Generator().manual_seed(m + exact))
    got = per_row_bits_match_alone(x, qweight, fmt, exact)
    expected = ref.quant_linear(x, qweight, fmt.type_id)
    torch.testing.assert_close(got[:exact], expected[:exact], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[exact:], expected[exact:], rtol=0.05, atol=0.05)  # int8 activations
    fp32 = ops.quant_linear(x, qweight, fmt, int8_activations=False, per_row=True)
    torch.testing.assert_close(fp32, expected, rtol=1e-4, atol=1e-4)


# Quant bytes at their extremes: Q5 nibbles 15 with every fifth bit (q = 31), Q8_0 -128 (|w| = 128,
# beyond gguf's quantizer's -127).
EXTREME_QUANTS = {"Q5_0": 0xFF, "Q5_1": 0xFF, "Q8_0": 0x80}


@pytest.mark.parametrize("sign", [1.0, -1.0])
@pytest.mark.parametrize("name", sorted(EXTREME_QUANTS))
def test_r8_extreme_quants_do_not_overflow(name: str, sign: float) -> None:
    """Every weight quant at its largest magnitude against activation quants all +-127 (every
    activation equal): the integer sums reach their bounds (int16 pairs on AVX2's maddubs, Q8_0's
    w + 128 on VNNI) and still equal the reference on the int8-rounded activations, r8 and GGUF order."""
    base = FORMATS[name]
    n, k = 16, 128
    blocks = torch.full((n, k // 32, base.block_bytes), EXTREME_QUANTS[name], dtype=torch.uint8)
    blocks[..., :2] = torch.tensor([0.01], dtype=torch.float16).view(torch.uint8)
    if name == "Q5_1":
        blocks[..., 2:4] = torch.tensor([-0.25], dtype=torch.float16).view(torch.uint8)
    packed = blocks.reshape(n, -1).contiguous()
    x = torch.full((5, k), sign)
    expected = ref.quant_linear(ref.int8_activations(x), packed, base.type_id)
    r8, fmt = interleave(packed, base)
    for qweight, layout in ((packed, base), (r8, fmt)):
        torch.testing.assert_close(ops.quant_linear(x, qweight, layout), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("base", sorted(INTERLEAVED, key=lambda f: f.name), ids=lambda f: f.name)
def test_r8_exact_rows_are_fixed_gemm_on_the_dequantized_weight(base: QuantFormat) -> None:
    """Every eight-row layout's fp32 (exact) rows, at 1 to 37 rows, over 9 groups (a last partial
    panel) and K = 2,304 (two panel depths, 1,280 + 1,024) with bias and without: the bits of
    ``quant_fixed_gemm`` and of ``fixed_gemm`` on the dequantized weight (one fma chain per output
    over k), so deterministic mode may take either."""
    k = 2304
    packed = ref.quantize(torch.randn(72, k, generator=torch.Generator().manual_seed(3)) * 0.05, base.type_id)
    r8, fmt = interleave(packed, base)
    dense = ops.quant.dequantize(r8, fmt, k)
    gen = torch.Generator().manual_seed(4)
    x, bias = torch.randn(37, k, generator=gen), torch.randn(72, generator=gen)
    for m in (1, 2, 5, 13, 37):
        for b in (bias, None):
            got = ops.quant_linear(x[:m], r8, fmt, b, exact_rows=m)
            assert torch.equal(got, fixed_gemm_linear(x[:m], r8, fmt, b)), (m, b is None)
            assert torch.equal(got, ops.linear(x[:m], dense, b, fixed=ops.pack_fixed(dense))), (m, b is None)


@pytest.mark.parametrize("base", sorted(R8, key=lambda f: f.name), ids=lambda f: f.name)
@pytest.mark.parametrize("m", [1, 5, 40])
def test_r8_exact_rows_are_gguf_orders_within_rounding(base: QuantFormat, m: int) -> None:
    """fp32 activations on an r8 layout (the panel kernel: one FMA chain per output over k) stay within
    fp32 summation order of the GGUF-order layout's dot products, on the same dequantized values."""
    packed, _ = _packed(base, 64, 576, m)
    r8, fmt = interleave(packed, base)
    x = torch.randn(m, 576, generator=torch.Generator().manual_seed(m))
    bias = torch.randn(64)
    want = ops.quant_linear(x, packed, base, bias, int8_activations=False)
    got = ops.quant_linear(x, r8, fmt, bias, int8_activations=False)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
