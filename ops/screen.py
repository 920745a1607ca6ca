"""Greedy tokens from a bf16 screen of the logits, decided in fp32: the argmax of fp32 logits
for a fraction of the lm_head's cost.

On a CPU with native bf16 dot products (AVX512-BF16, AMX) a bf16 GEMM runs faster than the fp32
one. Its logits are only approximate, but their error has a bound, so they can rule tokens out: a
token is a candidate only if its upper bound reaches the row's largest lower bound. The few
candidates get their fp32 logit, a dot product of the hidden row and the weight row, and the
row's token is the first maximum among them, which is the first maximum of those fp32 logits over
the whole vocabulary. It can differ from the argmax of another fp32 GEMM only where
the two largest logits agree to within fp32 rounding of the summation order, as two fp32 GEMMs can.

The bound (``screen_bounds``), for hidden row ``h`` (K values) and weight row ``w_j``, with
``u = 2^-8`` (bf16 rounding) and ``g = K 2^-24 / (1 - K 2^-24)`` (an fp32 sum of K terms):
the bf16 inputs are within ``u`` relative of ``h`` and ``w_j``, their products are exact in fp32
and their fp32 sum is within ``g`` relative of the sum of their magnitudes, so before its output
is rounded the screen is within ``((1 + u)^2 (1 + g) - 1) sum|h_i w_ji|`` of the exact dot
product, and any fp32 logit within ``g sum|h_i w_ji|`` of it; ``sum|h_i w_ji| <= |h| |w_j|``
(Cauchy-Schwarz). Rounding the output to bf16 (nearest or truncated) adds at most
``2u / (1 - 2u) |approx|``. Both constants are inflated slightly to cover the kernel's own fp32
arithmetic on them, and the kernel adds 1e-30 to ``error_scale |h|`` for the denormals that bf16
dot-product instructions flush to zero.
"""

from __future__ import annotations

import math
from functools import cache

import torch

from ops import isa, reference
from ops.build import cpu_ops
from ops.linear import PACK_BATCH_HINT, can_pack
from ops.policy import FASTEST, OpsPolicy

BF16_UNIT = 2.0**-8  # unit roundoff of bf16 (8 significant bits)
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo flags of CPUs with bf16 dot products


def screen_bounds(hidden_size: int) -> tuple[float, float]:
    """``(error_scale, output_slack)`` for a hidden size K: a screen logit is within
    ``error_scale |h| |w_j| + output_slack |approx_j|`` of any fp32 logit (module docstring)."""
    u, terms = BF16_UNIT, hidden_size * 2.0**-24
    g = terms / (1.0 - terms)
    error_scale = ((1.0 + u) ** 2 * (1.0 + g) - 1.0 + g) * (1.0 + 2.0**-10)
    return error_scale, 2.0 * u / (1.0 - 2.0 * u) + 2.0**-16


def weight_norms(weight: torch.Tensor) -> torch.Tensor:
    """fp32 ``[N]``: the L2 norm of each row of ``weight [N, K]``, computed in fp64, rounded up."""
    norms = weight.detach().double().norm(dim=1)
    return torch.nextafter(norms.float(), torch.tensor(math.inf, device=weight.device))




def cpuinfo_native_bf16(cpuinfo: str) -> bool:
    """Whether /proc/cpuinfo text lists a bf16 dot-product flag (NATIVE_BF16_FLAGS) on its first CPU."""
    return bool(isa.parse_flags(cpuinfo) & set(NATIVE_BF16_FLAGS))


BF16_KERNEL_FLAGS = ("avx512_bf16", "avx512vbmi")  # what csrc/cpu/quant_bf16.cpp compiles for (AMX: the tiles too)


def cpuinfo_bf16_kernel(cpuinfo: str) -> bool:
    """Whether /proc/cpuinfo text lists every flag the bf16 quantized kernel needs on its first CPU."""
    return set(BF16_KERNEL_FLAGS) <= isa.parse_flags(cpuinfo)


@cache
def native_bf16() -> bool:
    """Whether this CPU has bf16 dot-product instructions (read from /proc/cpuinfo; False elsewhere):
    without them a bf16 GEMM is emulated and no faster than fp32."""
    return bool(isa.flags() & set(NATIVE_BF16_FLAGS))  # under PAGEDSERVE_CPU_ISA


@cache
def bf16_kernel_cpu() -> bool:
    """Whether this CPU has what the bf16 quantized kernel needs (read from /proc/cpuinfo)."""
    return set(BF16_KERNEL_FLAGS) <= isa.flags()  # under PAGEDSERVE_CPU_ISA


def screened_argmax(approx: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor,
                    norms: torch.Tensor, *, policy: OpsPolicy = FASTEST) -> torch.Tensor:
    """int64 ``[rows]``: per row the first token maximizing the fp32 logit ``hidden[row] . weight[j]``,
    found through ``approx [rows, vocab]``, the bf16 logits of ``hidden`` rounded to bf16 times
    ``weight`` rounded to bf16 (fp32 accumulation). ``norms`` is ``weight_norms(weight)``.
    A row with a non-finite value gets -1: the caller computes that row's logits in full."""
    rows = approx.shape[0] if approx.dim() == 2 else -1
    vocab, k = weight.shape if weight.dim() == 2 else (-1, -1)
    if (approx.dim() != 2 or approx.dtype != torch.bfloat16 or hidden.shape != (rows, k)
            or hidden.dtype != torch.float32 or weight.dtype != torch.float32 or approx.shape[1] != vocab
            or vocab == 0 or norms.shape != (vocab,) or norms.dtype != torch.float32
            or len({t.device for t in (approx, hidden, weight, norms)}) != 1):
        raise ValueError(f"screened_argmax needs bf16 approx [rows, vocab], fp32 hidden [rows, K], fp32 weight "
                         f"[vocab, K] and fp32 norms [vocab] on one device; got {tuple(approx.shape)} {approx.dtype}, "
                         f"{tuple(hidden.shape)} {hidden.dtype}, {tuple(weight.shape)} {weight.dtype}, "
                         f"{tuple(norms.shape)} {norms.dtype}")
    error_scale, output_slack = screen_bounds(k)
    if policy.reference or approx.is_cuda:
        return reference.screened_argmax(approx, hidden, weight, norms, error_scale, output_slack)
    out = torch.empty(rows, dtype=torch.int64)
    if rows:
        if approx.stride(1) != 1:
            approx = approx.contiguous()
        cpu_ops().screened_argmax(out, approx, hidden.contiguous(), weight.contiguous(), norms.contiguous(),
                                  error_scale, output_slack)
    return out


@cache
def bf16_packing_available() -> bool:
    """Whether oneDNN can pack and run a bf16 GEMM on this CPU at all (it emulates bf16 dot
    products with AVX-512 but refuses on AVX2-only CPUs: "mkldnn bf16 path needs avx512bw")."""
    try:
        probe = torch.ones(16, 16)
        screen_logits(probe[:1], torch.ops.mkldnn._reorder_linear_weight(probe.bfloat16(), PACK_BATCH_HINT))
    except RuntimeError:
        return False
    return True


def pack_screen_weight(weight: torch.Tensor) -> torch.Tensor:
    """A bf16 copy of the fp32 CPU ``weight [N, K]`` in oneDNN's blocked GEMM layout (half the
    weight's bytes), for ``screen_logits``."""
    if not can_pack(weight):
        raise ValueError(f"only 2-D fp32 CPU weights can be screened; got {tuple(weight.shape)} {weight.dtype} "
                         f"on {weight.device}")
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().bfloat16().contiguous(), PACK_BATCH_HINT)


def screen_logits(hidden: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """bf16 ``[rows, N]``: ``hidden [rows, K]`` rounded to bf16 times the packed bf16 weight (oneDNN,
    fp32 accumulation): the ``approx`` of ``screened_argmax``."""
    return torch.ops.mkldnn._linear_pointwise(hidden.bfloat16(), packed, None, "none", [], "")
