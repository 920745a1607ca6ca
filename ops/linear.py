"""``linear``: ``nn.Linear``'s math with the fastest CPU path for the batch at hand.

- Up to ``SMALL_GEMM_MAX_ROWS`` rows of fp32 on the CPU (decode at small batch) a linear layer is
  bound by reading its weight once from memory: ``small_gemm`` (C++) streams the row-major weight
  at close to the memory bandwidth, well above torch's default GEMM (MKL) and oneDNN's.
- More rows: oneDNN's GEMM on a weight reordered once into its blocked layout (``pack_weight``),
  faster than MKL from 4 rows on, and ahead of ``small_gemm`` from 4 rows.
- Anything else (CUDA, bf16/fp16, no packed copy) is ``F.linear``.

Those choices give a row different bits at different row counts. With ``fixed`` (a
``pack_fixed`` copy, used under ``OpsPolicy.fixed_order``) every fp32 CPU row goes through
``fixed_gemm``: one fma chain per output over k in order, so a row's result does not depend on its
step (csrc/cpu/fixed_gemm.cpp).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ops import reference
from ops.build import cpu_ops
from ops.checks_fused import check_linear
from ops.policy import FASTEST, OpsPolicy

SMALL_GEMM_MAX_ROWS = 3  # csrc/cpu/ops.h kSmallGemmMaxRows
FIXED_LANES, FIXED_PANEL_GROUP = 16, 4  # csrc/cpu/ops.h kFixedGemmPanelGroup: panels of 16 columns
PACK_BATCH_HINT = 64  # rows oneDNN picks the blocked layout for; one layout serves every batch size


def can_pack(weight: torch.Tensor) -> bool:
    """A 2-D fp32 CPU weight, with oneDNN present: what ``pack_weight`` accepts."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2
            and torch.backends.mkldnn.is_available())


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """A oneDNN copy of ``weight [N, K]`` in its blocked GEMM layout (extra memory: one weight)."""
    if not can_pack(weight):
        raise ValueError(f"only 2-D fp32 CPU weights can be packed; got {tuple(weight.shape)} {weight.dtype} "
                         f"on {weight.device}")
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_BATCH_HINT)


def pack_fixed(weight: torch.Tensor) -> torch.Tensor:
    """``weight [N, K]`` (fp32, CPU) as ``fixed_gemm`` reads it: ``[P, K, 16]``, panel p holding rows
    16p..16p+15 column by column, P rounded up to a multiple of ``FIXED_PANEL_GROUP`` (zero rows)."""
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
        raise ValueError(f"only 2-D fp32 CPU weights pack for fixed_gemm; got {tuple(weight.shape)} {weight.dtype} "
                         f"on {weight.device}")
    rows, cols = weight.shape
    panels = -(-max(rows, 1) // FIXED_LANES)
    panels = -(-panels // FIXED_PANEL_GROUP) * FIXED_PANEL_GROUP
    padded = weight.new_zeros((panels * FIXED_LANES, cols))
    padded[:rows] = weight.detach()
    return padded.view(panels, FIXED_LANES, cols).transpose(1, 2).contiguous()


def fixed_linear(x: torch.Tensor, fixed: torch.Tensor, out_features: int,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ W.T + bias`` through ``fixed_gemm`` on ``fixed = pack_fixed(W)``: every row the
    same bits at any ``M``."""
    flat = x.reshape(-1, x.shape[-1])
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    out = x.new_empty((flat.shape[0], out_features))
    cpu_ops().fixed_gemm(out, flat, fixed, out_features, None if bias is None else bias.contiguous())
    return out.view(*x.shape[:-1], out_features)


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, packed: torch.Tensor | None = None,
    fixed: torch.Tensor | None = None, *, policy: OpsPolicy = FASTEST,
) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x [..., K]``, ``weight [N, K]``; ``packed`` is ``pack_weight(weight)``,
    ``fixed`` is ``pack_fixed(weight)`` (when given, every fp32 CPU row goes through ``fixed_gemm``);
    ``policy.reference``: the torch oracle."""
    check_linear(x, weight, bias)
    if policy.reference:
        return reference.linear(x, weight, bias)
    if x.is_cuda or x.dtype != torch.float32:
        return F.linear(x, weight, bias)
    if fixed is not None:
        return fixed_linear(x, fixed, weight.shape[0], bias)
    two_d = x.dim() == 2 and x.stride(1) == 1  # what the model passes: no reshape needed
    rows = x.shape[0] if two_d else x.numel() // max(1, x.shape[-1])
    if rows == 0:
        return F.linear(x, weight, bias)
    flat = x if two_d else x.reshape(rows, x.shape[-1]).contiguous()
    if rows <= SMALL_GEMM_MAX_ROWS and weight.is_contiguous():
        out = x.new_empty((rows, weight.shape[0]))
        cpu_ops().small_gemm(out, flat, weight, bias)
    elif packed is not None:
        out = torch.ops.mkldnn._linear_pointwise(flat, packed, bias, "none", [], "")
    else:
        return F.linear(x, weight, bias)
    return out if two_d else out.view(*x.shape[:-1], weight.shape[0])
