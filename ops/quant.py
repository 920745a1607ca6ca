"""``quant_linear``, the one entry of a linear layer on a GGUF-quantized weight (Q8_0, Q4_0, Q4_1,
Q5_0, Q5_1, IQ4_NL, MXFP4, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS), read in place.

A weight ``[N, K]`` is a contiguous uint8 tensor ``[N, K / fmt.block_size * fmt.block_bytes]`` (layout in
:mod:`ops.reference.quant`). On the CPU:

- up to ``QUANT_GEMV_MAX_ROWS`` rows (decode) the C++ kernel streams the packed blocks once, with
  the activations quantized per 32-block to int8 (integer dot products; ``int8_activations``);
- with bf16 linears (``quant_linear(..., bf16=True)``, a model in ``dtype`` bfloat16 on a CPU with AMX-BF16 or
  AVX512-BF16), any number of rows: the weight is dequantized to bf16 one 32-row panel at a time and
  multiplied on AMX tiles or with ``vdpbf16ps`` (no copy of the weight kept); a step takes this
  path from ``BF16_MIN_ROWS`` rows (deterministic mode: its prompt rows, at any count);
- more rows (prefill) the weight is dequantized into an fp32 scratch copy and multiplied by oneDNN,
  except a step's int8 rows on the eight-row layouts, which stay on the kernel at any count (there
  its int8 path beats oneDNN's fp32 GEMM, and a decode row then gets the
  same bits in a step of any size); their fp32 ``exact_rows`` go to oneDNN past the crossover.

The reference (``OpsPolicy.reference``) and non-CPU tensors dequantize in torch and multiply. Which
of these runs is one decision (``route``: the policy, what the caller asks for, the row count) and
one table of implementations (``_PATHS``), behind the one entry ``quant_linear``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from functools import cache
from typing import Any

import torch
import torch.nn.functional as F

from ops.build import cpu_ops
from ops.policy import FASTEST, OpsPolicy
from ops.reference import quant as ref

BF16_MIN_ROWS = 32  # a step's linears run on bf16 AMX tiles (`quant_linear(..., bf16=True)`) from this many rows,
BF16_MIN_PROMPT_ROWS = 8  # or this many prompt rows: the one-thread crossovers
# (benchmarks/kernels/quant_rows_bench.py); two threads cross over lower, kept here so fewer steps change arithmetic
QUANT_GEMV_MAX_ROWS = 128  # crossover to dequantize + oneDNN, one thread (benchmarks/kernels/quant_bench.py)


@dataclass(frozen=True, slots=True)
class QuantFormat:
    """A GGUF block format: its name, ggml type id, bytes per block and weights per block (32, or
    256 for the K-quants)."""

    name: str
    type_id: int
    block_bytes: int
    block_size: int = ref.BLOCK

    def row_bytes(self, in_features: int) -> int:
        """Packed bytes of one weight row of ``in_features`` weights."""
        return in_features // self.block_size * self.block_bytes


Q8_0 = QuantFormat("Q8_0", ref.Q8_0, ref.BLOCK_BYTES[ref.Q8_0])
Q4_0 = QuantFormat("Q4_0", ref.Q4_0, ref.BLOCK_BYTES[ref.Q4_0])
Q4_1 = QuantFormat("Q4_1", ref.Q4_1, ref.BLOCK_BYTES[ref.Q4_1])
Q5_0 = QuantFormat("Q5_0", ref.Q5_0, ref.BLOCK_BYTES[ref.Q5_0])
Q5_1 = QuantFormat("Q5_1", ref.Q5_1, ref.BLOCK_BYTES[ref.Q5_1])
Q2_K = QuantFormat("Q2_K", ref.Q2_K, ref.BLOCK_BYTES[ref.Q2_K], 256)
Q3_K = QuantFormat("Q3_K", ref.Q3_K, ref.BLOCK_BYTES[ref.Q3_K], 256)
Q4_K = QuantFormat("Q4_K", ref.Q4_K, ref.BLOCK_BYTES[ref.Q4_K], 256)
IQ4_NL = QuantFormat("IQ4_NL", ref.IQ4_NL, ref.BLOCK_BYTES[ref.IQ4_NL])
MXFP4 = QuantFormat("MXFP4", ref.MXFP4, ref.BLOCK_BYTES[ref.MXFP4])
Q5_K = QuantFormat("Q5_K", ref.Q5_K, ref.BLOCK_BYTES[ref.Q5_K], 256)
Q6_K = QuantFormat("Q6_K", ref.Q6_K, ref.BLOCK_BYTES[ref.Q6_K], 256)
IQ4_XS = QuantFormat("IQ4_XS", ref.IQ4_XS, ref.BLOCK_BYTES[ref.IQ4_XS], 256)
FORMATS = {f.name: f for f in (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, MXFP4, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS)}
# The layouts whose bf16 panels csrc/cpu/quant_bf16.cpp dequantizes (for AMX tiles and AVX512-BF16
# alike; a K-quant block fills eight 32-weight k blocks of a panel). For any other, bf16 `quant_linear`
# runs dequantized in torch (the same rounding), a model's prompt rows keep fp32 activations
# (`QuantLinear`), and the fused decoder, which calls the AMX kernel for every linear, declines it there.
BF16_FORMATS = frozenset({"Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "MXFP4", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                          "Q6_K", "IQ4_XS", "Q4_0r8", "Q4_1r8", "Q5_0r8", "Q5_1r8", "Q8_0r8", "Q4_Kr8", "Q6_Kr8"})
# The CPU kernel's eight-row interleaved layouts (ops/reference/quant.py, interleave; csrc/cpu/quant_interleaved.cpp,
# quant_interleaved_q5q8.cpp, quant_interleaved_k.cpp): Q4_Kr8's tiles carry Q4_K's scales and mins unpacked to
# bytes, 148 bytes a row per 256 weights; the others keep their formats' sizes.
Q4_0R8 = QuantFormat("Q4_0r8", ref.Q4_0R8, ref.BLOCK_BYTES[ref.Q4_0R8])
Q4_1R8 = QuantFormat("Q4_1r8", ref.Q4_1R8, ref.BLOCK_BYTES[ref.Q4_1R8])
Q5_0R8 = QuantFormat("Q5_0r8", ref.Q5_0R8, ref.BLOCK_BYTES[ref.Q5_0R8])
Q5_1R8 = QuantFormat("Q5_1r8", ref.Q5_1R8, ref.BLOCK_BYTES[ref.Q5_1R8])
Q8_0R8 = QuantFormat("Q8_0r8", ref.Q8_0R8, ref.BLOCK_BYTES[ref.Q8_0R8])
Q4_KR8 = QuantFormat("Q4_Kr8", ref.Q4_KR8, ref.BLOCK_BYTES[ref.Q4_KR8], 256)
Q6_KR8 = QuantFormat("Q6_Kr8", ref.Q6_KR8, ref.BLOCK_BYTES[ref.Q6_KR8], 256)
INTERLEAVED = {Q4_0: Q4_0R8, Q4_1: Q4_1R8, Q5_0: Q5_0R8, Q5_1: Q5_1R8, Q8_0: Q8_0R8, Q4_K: Q4_KR8, Q6_K: Q6_KR8}


def quant_format(name: str) -> QuantFormat:
    """The format called ``name`` (e.g. ``"Q4_1"``); ValueError naming the supported ones."""
    if name not in FORMATS:
        raise ValueError(f"unsupported quantization format {name!r}; supported: {sorted(FORMATS)}")
    return FORMATS[name]


def check_qweight(qweight: torch.Tensor, fmt: QuantFormat, in_features: int) -> None:
    """ValueError unless ``qweight`` is a contiguous uint8 ``[N, in_features / 32 * block_bytes]``."""
    if not isinstance(fmt, QuantFormat):
        raise ValueError(f"fmt must be a QuantFormat (ops.quant.Q4_1, ...); got {fmt!r}")
    if in_features % fmt.block_size:
        raise ValueError(f"in_features must be a multiple of {fmt.block_size} for {fmt.name}; got {in_features}")
    if qweight.dtype != torch.uint8 or qweight.dim() != 2 or not qweight.is_contiguous():
        raise ValueError(f"qweight must be a contiguous 2-D uint8 tensor; got {tuple(qweight.shape)} "
                         f"{qweight.dtype}")
    if qweight.shape[1] != fmt.row_bytes(in_features):
        raise ValueError(f"qweight rows are {qweight.shape[1]} bytes; {fmt.name} with K={in_features} needs "
                         f"{fmt.row_bytes(in_features)}")
    if fmt in INTERLEAVED.values() and qweight.shape[0] % ref.ROWS_PER_GROUP:
        raise ValueError(f"a {fmt.name} weight has a multiple of {ref.ROWS_PER_GROUP} rows; got {qweight.shape[0]}")


def interleave(qweight: torch.Tensor, fmt: QuantFormat) -> tuple[torch.Tensor, QuantFormat]:
    """``(qweight, fmt)`` in the CPU kernel's eight-row layout where it has one (Q4_0 / Q4_1 / Q5_0 / Q5_1 /
    Q8_0 / Q4_K / Q6_K, a multiple of 8 rows), else as given. The same bytes and shape, except Q4_K: its
    scales and mins unpacked, 148 bytes a row per block. The one-row GEMV on it runs fewer
    instructions per block (csrc/cpu/quant_interleaved.cpp, quant_interleaved_q5q8.cpp, quant_interleaved_k.cpp)."""
    target = INTERLEAVED.get(fmt)
    if target is None or qweight.shape[0] % ref.ROWS_PER_GROUP:
        return qweight, fmt
    return ref.interleave(qweight, fmt.type_id), target


def dequantize(qweight: torch.Tensor, fmt: QuantFormat, in_features: int | None = None, *,
               policy: OpsPolicy = FASTEST) -> torch.Tensor:
    """fp32 ``[N, K]`` of a packed weight (K from the row bytes unless given)."""
    k = in_features if in_features is not None else qweight.shape[1] // fmt.block_bytes * fmt.block_size
    check_qweight(qweight, fmt, k)
    if policy.reference or qweight.device.type != "cpu":
        return ref.dequantize(qweight, fmt.type_id)
    out = torch.empty((qweight.shape[0], k), dtype=torch.float32)
    cpu_ops().dequantize_weight(out, qweight, fmt.type_id)
    return out


def screened_argmax(approx: torch.Tensor, hidden: torch.Tensor, qweight: torch.Tensor, fmt: QuantFormat,
                    norms: torch.Tensor, rounding: float, norm_slack: float,
                    row_scales: torch.Tensor | None = None, *,
                    policy: OpsPolicy = FASTEST) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens, candidates)`` int64 ``[rows]``: the greedy tokens of a quantized lm_head with fp32
    activations found through its int8-activation logits ``approx`` (engine/model/quant_screen.py
    has the bound), and how many tokens per row needed their fp32-activation logit; token -1 for a
    row with a non-finite value (the caller computes that row in full). ``row_scales`` (fp32
    ``[rows]``): ``approx`` came from another screen whose error is at most ``row_scales[r] *
    norms[j]``, which then replaces the int8 bound. ``approx`` may be bf16 (the bf16 screen's
    output as the GEMM gives it: each row is widened inside the kernel)."""
    if row_scales is not None:
        row_scales = row_scales.float().contiguous()
    if policy.reference or not hidden.is_cpu:
        return ref.screened_argmax(approx.float(), hidden, qweight, fmt.type_id, norms, rounding, norm_slack,
                                   row_scales)
    rows = hidden.shape[0]
    tokens = torch.empty(rows, dtype=torch.int64)
    counts = torch.empty(rows, dtype=torch.int64)
    cpu_ops().quant_screened_argmax(tokens, counts, approx.contiguous(), hidden.contiguous(), qweight,
                                    fmt.type_id, norms, rounding, norm_slack, row_scales)
    return tokens, counts


def bf16_all_rows(policy: OpsPolicy = FASTEST) -> bool:
    """Whether a model's bf16 linears take every row of a step of many rows (``bf16_step``): on AMX
    tiles outside deterministic mode, where they beat the int8 kernel from ~32 rows. Elsewhere only
    a step's prompt rows compute in bf16, at any count, and its other rows keep the int8 kernel:
    with AVX512-BF16 (``vdpbf16ps`` runs half the MACs a cycle of the int8 kernel's ``vpdpbusd``: the
    int8 rows stay faster at every count) and in deterministic mode (a row's arithmetic may not
    depend on how many rows its step has)."""
    return bf16_kernel() == "amx" and not policy.fixed_order


def bf16_step(rows: int, prompt_rows: int) -> bool:
    """Whether a step of ``rows`` tokens, ``prompt_rows`` of them prompt tokens, runs its linears on
    ``quant_linear(..., bf16=True)`` in a model whose quantized linears compute in bf16 (the crossovers above)."""
    return rows >= BF16_MIN_ROWS or prompt_rows >= BF16_MIN_PROMPT_ROWS


@cache
def amx_bf16() -> bool:
    """Whether bf16 ``quant_linear`` runs on the compiled AMX-BF16 kernel here (built for a CPU
    with AMX-BF16, and the OS granted the tile state)."""
    return cpu_ops().amx_bf16_available()


@cache
def bf16_kernel() -> str | None:
    """The compiled kernel bf16 ``quant_linear`` runs on here: "amx" (AMX-BF16 tiles), "avx512_bf16"
    (``vdpbf16ps`` dot products on the same panels) or None (it then runs in torch: same rounding,
    other summation order, far slower)."""
    return {2: "amx", 1: "avx512_bf16"}.get(int(cpu_ops().bf16_linear_kernel()))


class QuantPath(Enum):
    """How one call of ``quant_linear`` computes: ``route`` picks one, ``_PATHS`` runs it."""

    TORCH = "torch"  # dequantized and multiplied in torch on fp32 activations (the reference; non-CPU tensors)
    TORCH_BF16 = "torch_bf16"  # the same with x and the weights rounded to bf16 (the reference; no bf16 kernel)
    BF16 = "bf16"  # the bf16 kernel ``bf16_kernel()`` names, on panels dequantized one at a time
    KERNEL = "kernel"  # the C++ kernel on every row: int8 rows and the leading exact rows, a row's bits at any count
    FIXED = "fixed"  # fixed order: the kernel, or GGUF-order exact rows on ``quant_fixed_gemm`` where it pays
    SPLIT = "split"  # many rows of an eight-row layout: int8 rows on the kernel, exact rows past a crossover on oneDNN
    ONEDNN = "onednn"  # many rows: the weight dequantized into an fp32 scratch copy, multiplied by oneDNN


def route(x: torch.Tensor, fmt: QuantFormat, int8_activations: bool, exact_rows: int, bf16: bool, per_row: bool,
          policy: OpsPolicy) -> QuantPath:
    """The path of a ``quant_linear`` call, from the policy, what the caller asks for and the row count
    (module docstring): the reference and non-CPU tensors in torch; bf16 on its kernel where there is one;
    ``per_row`` on the kernel at every count; fixed order on one arithmetic per row; else the GEMV
    kernel up to ``QUANT_GEMV_MAX_ROWS`` rows and oneDNN past it (an eight-row layout's int8 rows excepted)."""
    on_kernels = x.is_cpu and not policy.reference
    if bf16:
        usable = on_kernels and bf16_kernel() is not None and fmt.name in BF16_FORMATS
        return QuantPath.BF16 if usable else QuantPath.TORCH_BF16
    if not on_kernels:
        return QuantPath.TORCH
    if per_row:
        return QuantPath.KERNEL
    two_d = x.dim() == 2 and x.stride(1) == 1
    rows = x.shape[0] if x.dim() == 2 else x.numel() // max(1, x.shape[-1])
    if two_d and rows > 0 and policy.fixed_order:
        return QuantPath.FIXED
    if rows <= QUANT_GEMV_MAX_ROWS:
        return QuantPath.KERNEL
    exact = min(exact_rows, rows) if x.dim() == 2 else 0
    if int8_activations and fmt in INTERLEAVED.values() and exact < rows:
        return QuantPath.SPLIT
    return QuantPath.ONEDNN


def quant_linear(x: torch.Tensor, qweight: torch.Tensor, fmt: QuantFormat, bias: torch.Tensor | None = None,
                 int8_activations: bool = True, *, checked: bool = False, exact_rows: int = 0, bf16: bool = False,
                 per_row: bool = False, out: torch.Tensor | None = None,
                 policy: OpsPolicy = FASTEST) -> torch.Tensor:
    """fp32 ``x [..., K] @ dequantize(qweight).T + bias`` → ``[..., N]``, the one entry of every
    quantized linear: ``route`` picks the path, ``_PATHS`` runs it.

    ``int8_activations``: the rows of ``x`` are rounded per 32-block to int8, except the first
    ``exact_rows`` (of a 2-D ``x``: a step's prompt tokens), which keep fp32 activations. ``bf16``:
    ``x`` and the dequantized weights rounded to bf16 (nearest even), the products summed in fp32
    (``int8_activations`` and ``exact_rows`` then do not apply). ``per_row``: every row on the C++
    kernel at any row count, never oneDNN, so a row's bits do not depend on how many rows share the
    call (a MoE expert's grouped rows, the int8 rows of a mixed bf16 step). ``checked``: the caller
    validated ``qweight`` and ``bias`` against ``fmt`` already (``QuantLinear`` does at construction;
    the kernel still checks K against the packed rows): a decode step makes ~120 of these calls.
    ``out`` (fp32 ``[M, N]`` with contiguous rows, for a 2-D ``x``): written and returned.
    ``policy``: the reference (torch, fp32 activations) or the kernels, fastest or in fixed order."""
    if x.dtype != torch.float32:
        raise ValueError(f"x must be fp32; got {x.dtype}")
    n = qweight.shape[0]
    if not checked:
        check_qweight(qweight, fmt, x.shape[-1])
        if bias is not None and (bias.shape != (n,) or bias.dtype != torch.float32):
            raise ValueError(f"bias must be fp32 [{n}]; got {tuple(bias.shape)} {bias.dtype}")
    path = route(x, fmt, int8_activations, exact_rows, bf16, per_row, policy)
    result = _PATHS[path](x, qweight, fmt, bias, int8_activations, exact_rows, out)
    return result if out is None or result is out else out.copy_(result)


def _torch(x: torch.Tensor, qweight: torch.Tensor, fmt: QuantFormat, bias: torch.Tensor | None,
           int8_activations: bool, exact_rows: int, out: torch.Tensor | None) -> torch.Tensor:
    return ref.quant_linear(x, qweight, fmt.type_id, bias)


def _torch_bf16(x: torch.Tensor, qweight: torch.Tensor, fmt: QuantFormat, bias: torch.Tensor | None,
                int8_activations: bool, exact_rows: int, out: torch.Tensor | None) -> torch.Tensor:
    flat = x.reshape(-1, x.shape[-1])
    return ref.quant_linear_bf16(flat, qweight, fmt.type_id, bias).view(*x.shape[:-1], qweight.shape[0])


def _bf16(x: torch.Tensor, qweight: torch.Tensor, fmt: QuantFormat, bias: torch.Tensor | None,
          int8_activations: bool, exact_rows: int, out: torch.Tensor | None) -> torch.Tensor:
    n = qweight.shape[0]
    flat = x.reshape(-1, x.shape[-1])
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    if out is None:
        out = flat.new_empty((flat.shape[0], n))
        cpu_ops().quant_linear_bf16(out, flat, qweight, fmt.type_id, bias)
        return out.view(*x.shape[:-1], n)
    cpu_ops().quant_linear_bf16(out, flat, qweight, fmt.type_id, bias)
    return out


def _on_kernel(x: torch.Tensor, qweight: torch.Tensor, fmt: QuantFormat, bias: torch.Tensor | None,
               int8_activations: bool, exact_rows: int, out: torch.Tensor | None) -> torch.Tensor:
    n = qweight.shape[0]
    flat = x.reshape(-1, x.shape[-1])
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    result = flat.new_empty((flat.shape[0], n)) if out is None else out
    if flat.shape[0]:
        _kernel()(result, flat, qweight, fmt.type_id, bias, int8_activations, exact_rows if x.dim() == 2 else 0)
    return result if out is not None else result.view(*x.shape[:-1], n)


def _fixed(x: torch.Tensor, qweight: torch.Tensor, fmt: QuantFormat, bias: torch.Tensor | None,
           int8_activations: bool, exact_rows: int, out: torch.Tensor | None) -> torch.Tensor:
    """Fixed order (a 2-D ``x``): a row gets the same bits at any row count (oneDNN past the
    crossover would not). The int8 rows run on the kernel. The exact (fp32-activation) rows of the
    eight-row layouts too: their fp32 panels are fixed_gemm's fma chain over the dequantized weight,
    the bits ``quant_fixed_gemm`` gives, faster at every count (AVX2 and AVX-512); those of
    GGUF-order weights through ``quant_fixed_gemm`` where it pays (``_fixed_gemm_pays``)."""
    rows = x.shape[0]
    exact = rows if not int8_activations else max(0, min(exact_rows, rows))
    if not exact or fmt in INTERLEAVED.values() or not _fixed_gemm_pays():
        return _on_kernel(x, qweight, fmt, bias, int8_activations, exact_rows, out)
    result = x.new_empty((rows, qweight.shape[0])) if out is None else out
    cpu_ops().quant_fixed_gemm(result[:exact], x[:exact], qweight, fmt.type_id, bias)
    if exact < rows:
        _kernel()(result[exact:], x[exact:], qweight, fmt.type_id, bias, True, 0)
    return result


def _split(x: torch.Tensor, qweight: torch.Tensor, fmt: QuantFormat, bias: torch.Tensor | None,
           int8_activations: bool, exact_rows: int, out: torch.Tensor | None) -> torch.Tensor:
    """Many rows of an eight-row layout with int8 activations: the int8 rows stay on the kernel at
    any count (its int8 path beats oneDNN's fp32 GEMM there, and a decode row then gets the same
    bits in a step of any size); the exact rows go to oneDNN past the crossover."""
    k, n = x.shape[-1], qweight.shape[0]
    flat = x.reshape(-1, k)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    rows = flat.shape[0]
    exact = min(exact_rows, rows) if x.dim() == 2 else 0
    result = flat.new_empty((rows, n))
    if exact <= QUANT_GEMV_MAX_ROWS:
        _kernel()(result, flat, qweight, fmt.type_id, bias, True, exact)
    else:
        result[:exact] = F.linear(flat[:exact], dequantize(qweight, fmt, k), bias)
        _kernel()(result[exact:], flat[exact:], qweight, fmt.type_id, bias, True, 0)
    return result.view(*x.shape[:-1], n)


def _onednn(x: torch.Tensor, qweight: torch.Tensor, fmt: QuantFormat, bias: torch.Tensor | None,
            int8_activations: bool, exact_rows: int, out: torch.Tensor | None) -> torch.Tensor:
    k = x.shape[-1]
    flat = x.reshape(-1, k)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    return F.linear(flat, dequantize(qweight, fmt, k), bias).view(*x.shape[:-1], qweight.shape[0])


_PathFn = Callable[[torch.Tensor, torch.Tensor, QuantFormat, torch.Tensor | None, bool, int, torch.Tensor | None],
                   torch.Tensor]
# the one table: each path's implementation, the same arguments for all
_PATHS: dict[QuantPath, _PathFn] = {
    QuantPath.TORCH: _torch, QuantPath.TORCH_BF16: _torch_bf16, QuantPath.BF16: _bf16, QuantPath.KERNEL: _on_kernel,
    QuantPath.FIXED: _fixed, QuantPath.SPLIT: _split, QuantPath.ONEDNN: _onednn,
}


@cache
def _fixed_gemm_pays() -> bool:
    """Whether fixed order's exact rows of GGUF-order weights run on ``quant_fixed_gemm``: with
    AVX-512 its tiles beat that kernel's exact rows from some tens of rows on; with AVX2 they do
    not. The eight-row layouts' own exact rows beat both."""
    from ops import isa

    return "avx512f" in isa.flags()


@cache
def _kernel() -> Any:
    """The C++ kernel's overload, resolved once (a packet call resolves it again each time)."""
    return cpu_ops().quant_linear.default
