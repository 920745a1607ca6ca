"""ops.quant on the 256-weight formats kept packed (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS: blocks the kernels
read as eight 32-weight sub-blocks, one activation block each): the kernels' dequantization is gguf's reference
bit for bit over random blocks (every scale, min and fp16 class), the int8-activation rows equal
the reference on the int8-rounded activations and the fp32 rows the fp32 product over odd row
counts, odd N and K = 256 n, with and without bias; a row's output is the same bits alone and in
any batch; the fixed-order GEMM is fixed_gemm on the dequantized weight. Run at every ISA level
the machine has (tests/ops/test_isa.py). Q4_Kr8 (Q4_K repacked eight rows at a time, its scales and mins
unpacked: ops/reference/quant_k_r8.py) and Q6_Kr8 (Q6_K's bytes reordered) run the same grid on weights of a
multiple of 8 rows: their dequantization and bf16 panels are the GGUF-order format's bits, their fp32
rows (the fp32 panel kernel) within summation order of them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import ops
from ops.build import cpu_ops
from ops.quant import FORMATS, IQ4_XS, Q2_K, Q3_K, Q4_K, Q4_KR8, Q5_K, Q6_K, Q6_KR8, QUANT_GEMV_MAX_ROWS, QuantFormat
from ops.reference import formats
from ops.reference import quant as ref
from tests.ops.per_row_checks import fixed_gemm_linear, per_row_bits_match_alone
from tests.ops.test_formats import _random_blocks

gguf = pytest.importorskip("gguf")
KQUANTS = [Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS]
LAYOUTS = [*KQUANTS, Q4_KR8, Q6_KR8]  # the GGUF-order formats and the eight-row layouts of 256-weight blocks
R8_BASE = {Q4_KR8: Q4_K, Q6_KR8: Q6_K}
SHAPES = [(37, 256), (130, 512), (96, 1536), (8, 768), (576, 256), (40, 512)]  # (N, K); 40: five r8 groups
ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 17, 33, QUANT_GEMV_MAX_ROWS, QUANT_GEMV_MAX_ROWS + 3]


def _qweight(fmt: QuantFormat, n: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=gen) * 0.05
    weight[0, 3] = 0.9  # an outlier: a coarse super-block scale
    weight[n - 1, :256] = 0.0  # an all-zero block: zero scales
    if fmt in R8_BASE:
        packed, laid_out = ops.quant.interleave(ref.quantize(weight, R8_BASE[fmt].type_id), R8_BASE[fmt])
        assert laid_out == fmt
        return packed
    return ref.quantize(weight, fmt.type_id)


def test_k_quants_are_packed_formats() -> None:
    for fmt in KQUANTS:
        table = formats.by_name(fmt.name)
        assert table.runs == formats.PACKED and FORMATS[fmt.name] is fmt
        assert (fmt.type_id, fmt.block_size, fmt.block_bytes) == (table.type_id, table.block_size, table.block_bytes)
    with pytest.raises(ValueError, match="multiple of 256 for Q6_K"):
        ops.quant_linear(torch.randn(1, 576), torch.zeros(2, 576 // 256 * 210, dtype=torch.uint8), Q6_K)
    with pytest.raises(ValueError, match="Q4_K with K=512 needs 288"):
        ops.quant_linear(torch.randn(1, 512), torch.zeros(2, 210, dtype=torch.uint8), Q4_K)
    with pytest.raises(RuntimeError, match="multiple of 256"):  # the kernel's own check
        cpu_ops().quant_linear(torch.empty(1, 2), torch.randn(1, 288), torch.zeros(2, 210, dtype=torch.uint8),
                                         Q6_K.type_id, None, True, 0)


@pytest.mark.parametrize("fmt", KQUANTS, ids=lambda f: f.name)
def test_kernel_dequantize_equals_gguf(fmt: QuantFormat) -> None:
    raw = _random_blocks(formats.by_name(fmt.name), 4096, seed=fmt.type_id + 100).reshape(64, -1)
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[fmt.name]).reshape(64, -1)
    np.testing.assert_array_equal(ops.dequantize(torch.from_numpy(raw), fmt).numpy(), expected)
    np.testing.assert_array_equal(ref.dequantize(torch.from_numpy(raw), fmt.type_id).numpy(), expected)


@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("fmt", LAYOUTS, ids=lambda f: f.name)
def test_kernel_matches_reference_at_every_row_count(fmt: QuantFormat, n: int, k: int) -> None:
    """Every row count the kernel splits into passes (4 rows a pass, 5 when five are left), bias on
    every other count: int8 activations equal the reference on the rounded activations (within
    ~1% of the fp32 product), fp32 activations the reference itself; the last row (in the last
    partial pass), and for the small batches of a speculative verify every row, is bit for bit the
    same alone. Past `QUANT_GEMV_MAX_ROWS` rows GGUF order runs dequantize + oneDNN in fp32; an r8
    layout's int8 rows stay on the kernel."""
    if fmt in R8_BASE and n % 8:
        pytest.skip("an interleaved weight has a multiple of 8 rows")
    qweight = _qweight(fmt, n, k, n + k)
    weight = ref.dequantize(qweight, fmt.type_id)
    gen = torch.Generator().manual_seed(n * k)
    x = torch.randn(max(ROWS), k, generator=gen)
    x[:, 3] *= 20  # an outlier in the first block of every row
    bias = torch.randn(n, generator=gen)
    for i, m in enumerate(ROWS):
        b = bias if i % 2 else None
        rows = x[:m]
        expected = rows @ weight.T + (0 if b is None else b)
        fp32 = ops.quant_linear(rows, qweight, fmt, b, int8_activations=False)
        torch.testing.assert_close(fp32, expected, rtol=1e-4, atol=1e-4)
        got = ops.quant_linear(rows, qweight, fmt, b)
        if m > QUANT_GEMV_MAX_ROWS and fmt not in R8_BASE:
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
            continue
        as_int8 = ref.int8_activations(rows) @ weight.T + (0 if b is None else b)
        torch.testing.assert_close(got, as_int8, rtol=1e-4, atol=1e-4)
        assert (got - expected).abs().max() <= 0.02 * expected.abs().max() + 1e-4
        for j in range(m) if m <= 9 else [m - 1]:
            alone = rows[j:j + 1]
            assert torch.equal(got[j:j + 1], ops.quant_linear(alone, qweight, fmt, b)), (m, j)
            if m <= QUANT_GEMV_MAX_ROWS:  # more fp32 rows: dequantize + oneDNN, whatever the layout
                assert torch.equal(fp32[j:j + 1], ops.quant_linear(alone, qweight, fmt, b, int8_activations=False))


@pytest.mark.parametrize("fmt", LAYOUTS, ids=lambda f: f.name)
@pytest.mark.parametrize(("m", "exact"), [(1, 1), (5, 2), (9, 8), (40, 37)])
def test_exact_rows_keep_fp32_activations(fmt: QuantFormat, m: int, exact: int) -> None:
    qweight = _qweight(fmt, 64, 512, m)
    gen = torch.Generator().manual_seed(m + exact)
    x = torch.randn(m, 512, generator=gen)
    bias = torch.randn(64, generator=gen)
    got = ops.quant_linear(x, qweight, fmt, bias, exact_rows=exact)
    assert torch.equal(got[:exact], ops.quant_linear(x[:exact], qweight, fmt, bias, int8_activations=False))
    assert torch.equal(got[exact:], ops.quant_linear(x[exact:], qweight, fmt, bias))


@pytest.mark.parametrize("fmt", LAYOUTS, ids=lambda f: f.name)
@pytest.mark.parametrize(("n", "k"), [(24, 256), (200, 512), (37, 768)])
def test_quant_fixed_gemm_is_fixed_gemm_on_the_dequantized_weight(fmt: QuantFormat, n: int, k: int) -> None:
    if fmt in R8_BASE and n % 8:
        pytest.skip("an interleaved weight has a multiple of 8 rows")
    g = torch.Generator().manual_seed(n + k)
    qweight = _qweight(fmt, n, k, n)
    weight = ops.quant.dequantize(qweight, fmt, k)
    bias = torch.randn(n, generator=g)
    x = torch.randn(37, k, generator=g)
    for rows in (1, 5, 37):
        got = fixed_gemm_linear(x[:rows], qweight, fmt, bias)
        assert torch.equal(got, ops.linear(x[:rows], weight, bias, fixed=ops.pack_fixed(weight))), rows
        assert torch.equal(got, fixed_gemm_linear(x, qweight, fmt, bias)[:rows]), rows


@pytest.mark.parametrize("fmt", LAYOUTS, ids=lambda f: f.name)
def test_bf16_linear_has_k_quant_panels(fmt: QuantFormat) -> None:
    """The bf16 kernels dequantize K-quant blocks into their panels (tests/ops/test_quant_linear_bf16.py
    runs the grid): bf16 `quant_linear` is the bf16 reference up to summation order, and a K that is
    not a whole number of 256-weight blocks is refused by the kernel too."""
    qweight = _qweight(fmt, 40, 256, 3)
    x = torch.randn(6, 256)
    assert fmt.name in ops.quant.BF16_FORMATS
    torch.testing.assert_close(ops.quant_linear(x, qweight, fmt, bf16=True),
                               ref.quant_linear_bf16(x, qweight, fmt.type_id), rtol=1e-5, atol=1e-5)
    if ops.quant.bf16_kernel() is not None:
        with pytest.raises(RuntimeError, match="multiple of 256"):
            cpu_ops().quant_linear_bf16(torch.empty(1, 40), torch.randn(1, 288), qweight, fmt.type_id, None)


@pytest.mark.parametrize("r8", list(R8_BASE), ids=lambda f: f.name)
def test_r8_layout_round_trips_and_dequantizes_as_gguf(r8: QuantFormat) -> None:
    """An r8 layout over random GGUF blocks (every scale and min value at every sub-block, every fp16
    class): `deinterleave` gives the GGUF bytes back, the tile is `block_bytes` a row per block (Q4_Kr8
    148, Q6_Kr8 210), and the kernel's and the reference's dequantization are gguf's bits; other row
    counts stay GGUF order."""
    base = R8_BASE[r8]
    raw = _random_blocks(formats.by_name(base.name), 4096, seed=r8.type_id).reshape(64, -1)
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[base.name]).reshape(64, -1)
    packed = torch.from_numpy(raw)
    laid_out, fmt = ops.quant.interleave(packed, base)
    assert fmt == r8 and laid_out.shape == (64, 64 * r8.block_bytes) and fmt.row_bytes(64 * 256) == laid_out.shape[1]
    assert r8.block_bytes == (148 if base == Q4_K else base.block_bytes)
    assert torch.equal(ref.deinterleave(laid_out, fmt.type_id), packed)
    np.testing.assert_array_equal(ref.dequantize(laid_out, fmt.type_id).numpy(), expected)
    np.testing.assert_array_equal(ops.dequantize(laid_out, fmt).numpy(), expected)
    odd = packed[:44]
    assert ops.quant.interleave(odd, base) == (odd, base)  # not a multiple of 8 rows: GGUF order
    with pytest.raises(ValueError, match="multiple of 8 rows"):
        ops.quant_linear(torch.randn(1, 256 * 64), laid_out[:44], fmt)
    with pytest.raises(ValueError, match=f"{r8.name} with K=512 needs {2 * r8.block_bytes}"):
        ops.quant_linear(torch.randn(1, 512), torch.zeros(8, 2 * r8.block_bytes + 8, dtype=torch.uint8), fmt)


@pytest.mark.parametrize("layout", list(R8_BASE), ids=lambda f: f.name)
@pytest.mark.parametrize(("n", "k"), [(8, 256), (24, 768), (40, 512), (136, 1536)])
def test_r8_is_gguf_order_on_panels_and_close_on_other_rows(layout: QuantFormat, n: int, k: int) -> None:
    """An r8 layout against its format in GGUF order on the same weights: the fixed-order GEMM and the
    bf16 panels give the same bits; fp32-activation rows (the fp32 panel kernel) and int8 rows differ
    only by fp32 summation order."""
    base = R8_BASE[layout]
    qweight = _qweight(base, n, k, n + k)
    r8, fmt = ops.quant.interleave(qweight, base)
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(11, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    torch.testing.assert_close(ops.quant_linear(x, r8, fmt, bias, int8_activations=False),
                               ops.quant_linear(x, qweight, base, bias, int8_activations=False), rtol=1e-5, atol=1e-5)
    assert torch.equal(fixed_gemm_linear(x, r8, fmt, bias),
                       fixed_gemm_linear(x, qweight, base, bias))
    if ops.quant.bf16_kernel() is not None:
        assert torch.equal(ops.quant_linear(x, r8, fmt, bias, bf16=True),
                           ops.quant_linear(x, qweight, base, bias, bf16=True))
    torch.testing.assert_close(ops.quant_linear(x, r8, fmt, bias), ops.quant_linear(x, qweight, base, bias),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", list(R8_BASE), ids=lambda f: f.name)
@pytest.mark.parametrize("m", [1, 3, 4, 5])
def test_r8_groups_in_pairs_equal_groups_alone(layout: QuantFormat, m: int) -> None:
    """With AVX-512 the Q4_Kr8 kernel runs two groups per 512-bit pass and an odd last group on the 256-bit
    one: each group of a five-group weight is bit for bit that group alone (a one-group weight)."""
    n, k = 40, 768
    r8, fmt = ops.quant.interleave(_qweight(R8_BASE[layout], n, k, m), R8_BASE[layout])
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    whole = ops.quant_linear(x, r8, fmt, bias)
    for g in range(n // 8):
        alone = ops.quant_linear(x, r8[8 * g:8 * g + 8].contiguous(), fmt, bias[8 * g:8 * g + 8])
        assert torch.equal(whole[:, 8 * g:8 * g + 8], alone), g


@pytest.mark.parametrize("layout", list(R8_BASE), ids=lambda f: f.name)
@pytest.mark.parametrize("m", [13, 32, 35])
def test_r8_every_row_of_a_batch_is_that_row_alone(layout: QuantFormat, m: int) -> None:
    """A batch of several four-row passes runs one group pair at a time with the pair's scales and
    unpacked quants shared by every pass (AVX2): every row, in a full pass or the last partial one (1 or
    3 rows), and every group, the odd last one too (nine groups), is bit for bit that row alone."""
    n, k = 72, 1536
    r8, fmt = ops.quant.interleave(_qweight(R8_BASE[layout], n, k, m), R8_BASE[layout])
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=gen)
    x[:, 5] *= 30  # an outlier: a coarse activation scale in the first block
    bias = torch.randn(n, generator=gen)
    whole = ops.quant_linear(x, r8, fmt, bias)
    for i in range(m):
        assert torch.equal(whole[i:i + 1], ops.quant_linear(x[i:i + 1], r8, fmt, bias)), i
    torch.testing.assert_close(whole, ref.quant_linear(ref.int8_activations(x), r8, fmt.type_id) + bias,
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("low", "high"), [(0x00, 0x00), (0xFF, 0xFF)], ids=["q-32", "q+31"])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_q6_k_sub_block_integers_reach_their_bound_exactly(low: int, high: int, sign: float) -> None:
    """Q6_Kr8 finishes a sub-block in integers (sc_0 (isum_0 - 32 asum_0) + sc_1 (isum_1 - 32 asum_1)): with
    every scale -128, every quant at an end (q - 32 = -32 or 31) and every activation quant +-127 the sum
    reaches 2 * 128 * 16 * 32 * 127, just under 2^24, and must still be exact. One row, the pair passes
    without (2-4 rows) and with their shared table (40 rows) and an odd last group, against the reference
    on the int8-rounded activations and against GGUF order."""
    n, k = 24, 512  # three groups: a pair and one alone
    blocks = torch.zeros((n, k // 256, 210), dtype=torch.uint8)
    blocks[..., 0:128], blocks[..., 128:192] = low, high  # ql, qh: every quant 0 or 63
    blocks[..., 192:208] = 0x80  # int8 scales -128
    blocks[..., 208:210] = torch.tensor([0.01], dtype=torch.float16).view(torch.uint8)
    packed = blocks.reshape(n, -1).contiguous()
    r8, fmt = ops.quant.interleave(packed, Q6_K)
    assert fmt == Q6_KR8
    for m in (1, 2, 3, 4, 40):
        x = torch.full((m, k), sign)
        expected = ref.quant_linear(ref.int8_activations(x), packed, Q6_K.type_id)
        got = ops.quant_linear(x, r8, fmt)
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=0, msg=f"{m} rows against the reference")
        torch.testing.assert_close(got, ops.quant_linear(x, packed, Q6_K), rtol=1e-6, atol=0,
                                   msg=f"{m} rows against GGUF order")


@pytest.mark.parametrize("layout", list(R8_BASE), ids=lambda f: f.name)
@pytest.mark.parametrize(("m", "exact"), [(1, 0), (40, 7), (QUANT_GEMV_MAX_ROWS + 40, 0)])
def test_r8_per_row_entry_keeps_every_count_on_the_kernel(layout: QuantFormat, m: int, exact: int) -> None:
    """`quant_linear(..., per_row=True)` (a MoE expert's grouped rows) on an r8 layout: each row is bit for bit what
    it is alone at any count, past the oneDNN crossover too."""
    r8, fmt = ops.quant.interleave(_qweight(R8_BASE[layout], 64, 512, m), R8_BASE[layout])
    x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m + exact))
    got = per_row_bits_match_alone(x, r8, fmt, exact)
    expected = ref.quant_linear(x, r8, fmt.type_id)
    torch.testing.assert_close(got[:exact], expected[:exact], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[exact:], ref.quant_linear(ref.int8_activations(x[exact:]), r8, fmt.type_id),
                               rtol=1e-4, atol=1e-4)
