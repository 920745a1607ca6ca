"""Multi-LoRA rows in plain torch: the oracle of the ``lora_rows`` kernel."""

from __future__ import annotations

import torch


def lora_rows(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
              slot_of_row: torch.Tensor) -> torch.Tensor:
    """``out[m] += (x[m] @ a[s].T) @ b[s].T`` with ``s = slot_of_row[m]`` (rows with ``s < 0`` left
    alone), in place; ``out [M, N]``, ``x [M, K]``, ``a [S, R, K]``, ``b [S, N, R]``. Returns ``out``."""
    index = (slot_of_row >= 0).nonzero().squeeze(1)
    if index.numel() == 0:
        return out
    slot = slot_of_row.index_select(0, index)
    xs = x.index_select(0, index).to(a.dtype)
    t = (a.index_select(0, slot) * xs.unsqueeze(1)).sum(-1)  # [n, R]
    delta = (b.index_select(0, slot) * t.unsqueeze(1)).sum(-1)  # [n, N]
    return out.index_add_(0, index, delta.to(out.dtype))
