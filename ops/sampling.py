"""Random sampling by inverse CDF: per row, the first token whose running probability mass
(softmax of ``logits * inv_temperature``, in token-id order) exceeds ``uniform`` times the total.

The C++ kernel reads each row once and keeps its exps in cache (the torch reference writes the
whole matrix three times: softmax, cumsum, search); CUDA tensors use the reference, which is
already one device kernel per op. Both give the same token except where ``uniform`` falls within
rounding of a boundary between two tokens' mass."""

from __future__ import annotations

import torch

from ops import reference
from ops.backend import use_reference
from ops.build import cpu_ops


def sample_from_logits(logits: torch.Tensor, inv_temperature: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """int64 ``[rows]`` tokens for fp32 ``logits [rows, vocab]``, ``inv_temperature [rows]`` and
    ``uniforms [rows]`` in [0, 1). Tokens whose logit is ``-inf`` are never drawn."""
    rows = logits.shape[0] if logits.dim() == 2 else -1
    if (logits.dim() != 2 or logits.dtype != torch.float32 or logits.shape[1] == 0
            or any(t.shape != (rows,) or t.dtype != torch.float32 or t.device != logits.device
                   for t in (inv_temperature, uniforms))):
        raise ValueError(f"sample_from_logits needs fp32 logits [rows, vocab] and fp32 [rows] temperatures and "
                         f"uniforms on one device; got {tuple(logits.shape)} {logits.dtype}, "
                         f"{tuple(inv_temperature.shape)} {inv_temperature.dtype}, {tuple(uniforms.shape)} "
                         f"{uniforms.dtype}")
    if use_reference() or logits.is_cuda:
        return reference.sample_from_logits(logits, inv_temperature, uniforms)
    out = torch.empty(rows, dtype=torch.int64)
    if rows:
        if logits.stride(1) != 1:
            logits = logits.contiguous()
        cpu_ops().sample_from_logits(out, logits, inv_temperature.contiguous(), uniforms.contiguous())
    return out
