"""Reference screened argmax: bounds in fp64, then the exact fp32 logits of the candidates."""

from __future__ import annotations

import torch


def screened_argmax(approx: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, norms: torch.Tensor,
                    error_scale: float, output_slack: float) -> torch.Tensor:
    x = approx.double()
    margin = (error_scale * hidden.double().norm(dim=1) + 1e-30).unsqueeze(1) * norms.double() + output_slack * x.abs()
    floor = (x - margin).max(dim=1, keepdim=True).values
    candidates = (x + margin) >= floor
    out = torch.full((approx.shape[0],), -1, dtype=torch.int64, device=approx.device)
    for r in range(approx.shape[0]):
        if not bool(torch.isfinite(x[r]).all()) or not bool(torch.isfinite(margin[r]).all()):
            continue
        ids = candidates[r].nonzero().squeeze(1)
        logits = weight.index_select(0, ids) @ hidden[r]
        out[r] = ids[logits.max(dim=0).indices]  # first maximum
    return out
