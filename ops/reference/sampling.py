"""Reference inverse-CDF sampling: softmax, cumulative sum, search; filters (top-k, top-p, min-p,
typical-p) by sorts and masks."""

from __future__ import annotations

import torch


def sample_from_logits(logits: torch.Tensor, inv_temperature: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    probs = torch.softmax(logits * inv_temperature.unsqueeze(1), dim=-1)
    cdf = probs.cumsum(dim=-1)
    picked = torch.searchsorted(cdf, (uniforms.unsqueeze(1) * cdf[:, -1:]).contiguous(), right=True)
    return picked.squeeze(1).clamp_max(logits.shape[1] - 1)


TOP_P_PROBE = 1024  # top-p first looks at this many most likely tokens, sorts the full row if short


def sample_filtered(logits: torch.Tensor, inv_temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                    min_p: torch.Tensor, uniforms: torch.Tensor, typical_p: torch.Tensor | None = None) -> torch.Tensor:
    probs = filtered_probs(logits, inv_temperature, top_k, top_p, min_p, typical_p)
    cdf = probs.cumsum(dim=-1)
    picked = torch.searchsorted(cdf, (uniforms.unsqueeze(1) * cdf[:, -1:]).contiguous(), right=True)
    return picked.squeeze(1).clamp_max(logits.shape[-1] - 1)


def filtered_probs(logits: torch.Tensor, inv_temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   min_p: torch.Tensor, typical_p: torch.Tensor | None = None) -> torch.Tensor:
    """The distribution `sample_filtered` draws from, unnormalized: softmax of the scaled logits
    with the filtered-out tokens at 0 (top-k, then top-p, then min-p, then typical-p)."""
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
    typical = None if typical_p is None else (typical_p < 1.0).nonzero().squeeze(1)
    if typical is not None and typical_p is not None and typical.numel():
        kept = scaled[typical].masked_fill(probs[typical] == 0, float("-inf"))
        probs[typical] = probs[typical].masked_fill_(_atypical(kept, typical_p[typical].unsqueeze(1)), 0.0)
    return probs


def _atypical(scaled: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """Locally typical sampling's cut (Meister et al. 2022, "Locally Typical Sampling"): rank the
    tokens by how far their surprisal -log p lies from the entropy H of the distribution and keep
    the nearest until their mass reaches `mass`, with every token as near as the last one kept.
    True for the tokens cut. `scaled` holds -inf for tokens already filtered out."""
    logp = torch.log_softmax(scaled, dim=-1)
    p = logp.exp()
    entropy = -(logp * p).nansum(dim=-1, keepdim=True)  # 0 * -inf is nan: a removed token adds nothing
    distance = (-logp - entropy).abs()
    nearest, order = torch.sort(distance, dim=-1)
    running = torch.softmax(scaled.gather(1, order), dim=-1).cumsum(dim=-1)  # the mass in that order
    last = (running < mass).sum(dim=-1, keepdim=True).clamp_max(scaled.shape[-1] - 1)
    return distance > nearest.gather(1, last)


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
