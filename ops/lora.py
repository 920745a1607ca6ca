"""Multi-LoRA rows: every row of a step through its own adapter slot in one call (the CPU kernel
``lora_rows``, one fixed summation order per row, or the torch reference)."""

from __future__ import annotations

import torch

from ops.build import cpu_ops
from ops.policy import FASTEST, OpsPolicy
from ops.reference import lora as reference


def kernel_applies(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, policy: OpsPolicy = FASTEST) -> bool:
    """Whether ``lora_rows`` runs the CPU kernel for these tensors (fp32 on the CPU, kernels on)."""
    return (not policy.reference and out.device.type == "cpu" and x.device.type == "cpu"
            and out.dtype == x.dtype == a.dtype == torch.float32 and out.stride(-1) == 1 and x.stride(-1) == 1)


def lora_rows(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
              slot_of_row: torch.Tensor, *, policy: OpsPolicy = FASTEST) -> torch.Tensor:
    """``out[m] += (x[m] @ a[s].T) @ b[s].T`` for ``s = slot_of_row[m] >= 0``, in place (``out
    [M, N]``, ``x [M, K]``, ``a [S, R, K]``, ``b [S, N, R]``, ``slot_of_row`` int64 ``[M]``).
    A row's result does not depend on the other rows. Returns ``out``."""
    if out.shape[0] != x.shape[0] or slot_of_row.shape != (x.shape[0],):
        raise ValueError(f"lora_rows: out {tuple(out.shape)}, x {tuple(x.shape)} and slot_of_row "
                         f"{tuple(slot_of_row.shape)} disagree on the rows")
    if not kernel_applies(out, x, a, policy):
        return reference.lora_rows(out, x, a, b, slot_of_row)
    if x.shape[0]:
        cpu_ops().lora_rows(out, x, a, b, slot_of_row.to(torch.int64))
    return out
