"""Reference inverse-CDF sampling: softmax, cumulative sum, search; filters by top-k, sort and masks."""

from __future__ import annotations

import torch


def sample_from_logits(logits: torch.Tensor, inv_temperature: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    probs = torch.softmax(logits * inv_temperature.unsqueeze(1), dim=-1)
    cdf = probs.cumsum(dim=-1)
    picked = torch.searchsorted(cdf, (uniforms.unsqueeze(1) * cdf[:, -1:]).contiguous(), right=True)
    return picked.squeeze(1).clamp_max(logits.shape[1] - 1)


TOP_P_PROBE = 1024  # top-p first looks at this many most likely tokens, sorts the full row if short


def sample_filtered(logits: torch.Tensor, inv_temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                    min_p: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    vocab = logits.shape[-1]
    scaled = logits * inv_temperature.unsqueeze(1)
    ks = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab)
    if int(ks.min()) < vocab:
        _mask_top_k(scaled, ks)
    probs = torch.softmax(scaled, dim=-1)
    cut = (top_p < 1.0).nonzero().squeeze(1)
    if cut.numel():
        probs[cut] = _mask_top_p(probs[cut], top_p[cut].unsqueeze(1))
    if bool((min_p > 0).any()):
        probs.masked_fill_(probs < min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True), 0.0)
    cdf = probs.cumsum(dim=-1)
    picked = torch.searchsorted(cdf, (uniforms.unsqueeze(1) * cdf[:, -1:]).contiguous(), right=True)
    return picked.squeeze(1).clamp_max(vocab - 1)


def _mask_top_k(scaled: torch.Tensor, ks: torch.Tensor) -> None:
    """In place: keep every token whose value reaches the row's k-th largest (ties at the cut kept)."""
    top = torch.topk(scaled, int(ks.max()), dim=-1).values
    kth = top.gather(1, (ks - 1).unsqueeze(1))
    scaled.masked_fill_(scaled < kth, float("-inf"))


def _mask_top_p(probs: torch.Tensor, ps: torch.Tensor) -> torch.Tensor:
    """Keep the most likely tokens until their mass reaches top_p (ties at the cut kept).

    The cut only needs the sorted values' prefix, so look at the TOP_P_PROBE largest first and
    sort the whole row only where that prefix falls short of top_p."""
    probe = min(TOP_P_PROBE, probs.shape[-1])
    head = torch.topk(probs, probe, dim=-1).values
    cut = _cut_value(head, ps)
    short = (head.cumsum(dim=-1)[:, -1:] < ps).squeeze(1).nonzero().squeeze(1)
    if short.numel() and probe < probs.shape[-1]:
        full = torch.sort(probs[short], dim=-1, descending=True).values
        cut[short] = _cut_value(full, ps[short])
    return probs.masked_fill_(probs < cut, 0.0)


def _cut_value(sorted_desc: torch.Tensor, ps: torch.Tensor) -> torch.Tensor:
    """Smallest kept probability: the value where the running mass first reaches p."""
    position = (sorted_desc.cumsum(dim=-1) < ps).sum(dim=-1, keepdim=True)
    return sorted_desc.gather(1, position.clamp_max(sorted_desc.shape[-1] - 1))
