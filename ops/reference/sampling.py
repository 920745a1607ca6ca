"""Reference inverse-CDF sampling: softmax, cumulative sum, search."""

from __future__ import annotations

import torch


def sample_from_logits(logits: torch.Tensor, inv_temperature: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    probs = torch.softmax(logits * inv_temperature.unsqueeze(1), dim=-1)
    cdf = probs.cumsum(dim=-1)
    picked = torch.searchsorted(cdf, (uniforms.unsqueeze(1) * cdf[:, -1:]).contiguous(), right=True)
    return picked.squeeze(1).clamp_max(logits.shape[1] - 1)
