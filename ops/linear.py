"""``linear``: ``nn.Linear``'s math, with a C++ kernel for the memory-bound small-batch case.

Up to ``SMALL_GEMM_MAX_ROWS`` rows of fp32 on the CPU (decode at small batch), a linear layer is
bound by reading its weight once from memory; ``small_gemm`` streams the weight at close to the
memory bandwidth. Larger batches, other dtypes and CUDA go to torch (MKL/oneDNN/cuBLAS).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ops import reference
from ops.backend import use_reference
from ops.build import cpu_ops
from ops.checks_fused import check_linear

SMALL_GEMM_MAX_ROWS = 8  # csrc/cpu/ops.h kSmallGemmMaxRows


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x [..., K]``, ``weight [N, K]``."""
    check_linear(x, weight, bias)
    if use_reference():
        return reference.linear(x, weight, bias)
    rows = x.numel() // max(1, x.shape[-1])
    if (
        x.is_cuda
        or x.dtype != torch.float32
        or not 0 < rows <= SMALL_GEMM_MAX_ROWS
        or not weight.is_contiguous()
    ):
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, x.shape[-1])
    if flat.stride(1) != 1:
        flat = flat.contiguous()
    out = x.new_empty((rows, weight.shape[0]))
    cpu_ops().small_gemm(out, flat, weight, bias)
    return out.view(*x.shape[:-1], weight.shape[0])
