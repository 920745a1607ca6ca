"""ops.quant.quant_linear(..., bf16=True): the compiled bf16 kernel (AMX-BF16 tiles, csrc/cpu/quant_amx.cpp, or
AVX512-BF16 dot products, csrc/cpu/quant_bf16_dot.cpp: whichever this CPU has) against the torch
reference (weights dequantized and rounded to bf16, activations rounded to bf16, fp32 sums) over a
grid of formats, shapes and row counts; its rows do not depend on the batch they run in."""

from __future__ import annotations

import pytest
import torch

import ops
from ops.quant import BF16_FORMATS, FORMATS, INTERLEAVED, QuantFormat, bf16_kernel, interleave, quant_linear
from ops.reference import quant as ref

# The layouts with bf16 panels: the 32-weight formats, their r8 layouts, and the K-quants (Q2_K-Q6_K, IQ4_XS).
LAYOUTS = {name: fmt for name, fmt in {**FORMATS, **{r8.name: r8 for r8 in INTERLEAVED.values()}}.items()
           if name in BF16_FORMATS}
BASE = {r8.name: base for base, r8 in INTERLEAVED.items()}
SHAPES = [(8, 32), (40, 96), (576, 576), (136, 1536), (960, 64)]  # (N, K) for 32-weight blocks
K_SHAPES = [(8, 256), (40, 768), (37, 512), (136, 1536), (576, 256)]  # 256-weight blocks: K = 256 n, odd N
GRID = [(name, n, k) for name, fmt in sorted(LAYOUTS.items())
        for n, k in (K_SHAPES if fmt.block_size == 256 else SHAPES)]
needs_kernel = pytest.mark.skipif(bf16_kernel() is None, reason="no bf16 kernel (AMX-BF16 or AVX512-BF16) here")


def _weight(name: str, n: int, k: int, seed: int) -> tuple[torch.Tensor, QuantFormat]:
    gen = torch.Generator().manual_seed(seed)
    dense = torch.randn(n, k, generator=gen) * 0.05
    base = BASE.get(name, FORMATS.get(name))
    assert base is not None
    packed = ref.quantize(dense, base.type_id)
    return interleave(packed, base) if name in BASE else (packed, base)


def _expected(x: torch.Tensor, packed: torch.Tensor, fmt: QuantFormat, bias: torch.Tensor | None) -> torch.Tensor:
    return ref.quant_linear_bf16(x, packed, fmt.type_id, bias)


@needs_kernel
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize(("name", "n", "k"), GRID)
@pytest.mark.parametrize("m", [1, 11, 12, 13, 15, 16, 17, 33, 64, 121, 130])
def test_kernel_matches_reference(m: int, name: str, n: int, k: int, with_bias: bool) -> None:
    packed, fmt = _weight(name, n, k, seed=n + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    bias = torch.randn(n) if with_bias else None
    got = quant_linear(x, packed, fmt, bias, bf16=True)
    want = _expected(x, packed, fmt, bias)
    # Same products, other summation order: fp32 rounding over k terms.
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@needs_kernel
def test_activation_blocks_past_l2_size() -> None:
    """Rows are taken in blocks whose packed copy fits L2 (~1.5 MiB: 512 rows at K=1536); more rows
    than a block, and a partial last block."""
    packed, fmt = _weight("Q4_1r8", 72, 1536, seed=1)
    x = torch.randn(1100, 1536)
    torch.testing.assert_close(quant_linear(x, packed, fmt, bf16=True), _expected(x, packed, fmt, None),
                               rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_panels_hold_the_reference_weights_in_bf16(name: str) -> None:
    """Each panel value is the reference dequantization rounded to bf16 (nearest even), bit for bit:
    a one-hot activation row k makes output n exactly the panel's weight (n, k)."""
    k = 768 if LAYOUTS[name].block_size == 256 else 96
    packed, fmt = _weight(name, 37 if name not in BASE else 40, k, seed=6)
    x = torch.eye(k)
    want = ref.dequantize(packed, fmt.type_id).bfloat16().float().T
    assert torch.equal(quant_linear(x, packed, fmt, bf16=True), want)


@needs_kernel
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_a_row_does_not_depend_on_its_batch(name: str) -> None:
    """Each output is its own row's sum in a fixed order: bit for bit the same alone, at any place in
    any batch (padding rows are zeros that never reach another row)."""
    k = 768 if LAYOUTS[name].block_size == 256 else 576
    packed, fmt = _weight(name, 96, k, seed=2)
    x = torch.randn(70, k)
    batch = quant_linear(x, packed, fmt, bf16=True)
    for i in (0, 15, 16, 31, 32, 69):
        assert torch.equal(quant_linear(x[i:i + 1], packed, fmt, bf16=True)[0], batch[i])
    assert torch.equal(quant_linear(x[5:40], packed, fmt, bf16=True), batch[5:40])


@needs_kernel
@pytest.mark.parametrize("name", sorted(BASE))
def test_r8_layouts_compute_as_gguf_order(name: str) -> None:
    """An r8 layout's panels are the GGUF order's, value for value: the same outputs bit for bit."""
    packed, fmt = _weight(name, 136, 768, seed=7)  # K = 256 n: the K-quants' layouts too
    gguf_order = ref.deinterleave(packed, fmt.type_id)
    x = torch.randn(45, 768)
    bias = torch.randn(136)
    assert torch.equal(quant_linear(x, packed, fmt, bias, bf16=True),
                       quant_linear(x, gguf_order, BASE[name], bias, bf16=True))


def test_reference_backend_and_fallback_round_the_same_way() -> None:
    """The torch path (reference backend, or a CPU without a bf16 kernel) rounds like the kernel."""
    packed, fmt = _weight("Q4_1r8", 64, 128, seed=3)
    x = torch.randn(20, 128)
    got = quant_linear(x, packed, fmt, bf16=True, policy=ops.REFERENCE)
    torch.testing.assert_close(got, _expected(x, packed, fmt, None), rtol=0, atol=0)
    if bf16_kernel() is not None:
        torch.testing.assert_close(quant_linear(x, packed, fmt, bf16=True), got, rtol=1e-5, atol=1e-5)


def test_bad_arguments_raise() -> None:
    packed, fmt = _weight("Q8_0", 32, 64, seed=4)
    with pytest.raises(ValueError, match="fp32"):
        quant_linear(torch.randn(2, 64).bfloat16(), packed, fmt, bf16=True)
    with pytest.raises(ValueError, match="bytes"):
        quant_linear(torch.randn(2, 96), packed, fmt, bf16=True)


@needs_kernel
def test_kernel_checks_its_inputs() -> None:
    from ops.build import cpu_ops

    packed, fmt = _weight("Q4_1r8", 32, 64, seed=5)
    with pytest.raises(RuntimeError, match="out must be"):
        cpu_ops().quant_linear_bf16(torch.empty(3, 31), torch.randn(3, 64), packed, fmt.type_id, None)
    with pytest.raises(RuntimeError, match="bias"):
        cpu_ops().quant_linear_bf16(torch.empty(3, 32), torch.randn(3, 64), packed, fmt.type_id, torch.randn(31))
