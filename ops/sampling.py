"""Random sampling by inverse CDF: per row, the first token whose running probability mass
(softmax of ``logits * inv_temperature``, in token-id order) exceeds ``uniform`` times the total;
``sample_filtered`` first applies top-k, top-p and min-p (what chat clients send).

The C++ kernel reads each row once and keeps its exps in cache (the torch reference writes the
whole matrix three times: softmax, cumsum, search); CUDA tensors use the reference, which is
already one device kernel per op. Both give the same token except where ``uniform`` falls within
rounding of a boundary between two tokens' mass."""

from __future__ import annotations

import torch

from ops import reference
from ops.build import cpu_ops
from ops.policy import FASTEST, OpsPolicy


def sample_from_logits(logits: torch.Tensor, inv_temperature: torch.Tensor, uniforms: torch.Tensor, *,
                       policy: OpsPolicy = FASTEST) -> torch.Tensor:
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
    if policy.reference or logits.is_cuda:
        return reference.sample_from_logits(logits, inv_temperature, uniforms)
    out = torch.empty(rows, dtype=torch.int64)
    if rows:
        if logits.stride(1) != 1:
            logits = logits.contiguous()
        cpu_ops().sample_from_logits(out, logits, inv_temperature.contiguous(), uniforms.contiguous())
    return out


def sample_filtered(logits: torch.Tensor, inv_temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                    min_p: torch.Tensor, uniforms: torch.Tensor, typical_p: torch.Tensor | None = None, *,
                    policy: OpsPolicy = FASTEST) -> torch.Tensor:
    """``sample_from_logits`` after per-row filters, in this order (vLLM's semantics; ties at a cut
    are kept): ``top_k`` (int64, > 0 and < vocab) keeps the logits reaching the k-th largest;
    ``top_p`` (< 1) keeps the largest probabilities until their mass reaches top_p; ``min_p``
    (> 0) keeps the probabilities of at least min_p times the largest; ``typical_p`` (fp32, < 1)
    keeps the locally typical tokens (`ops.reference.sampling.filtered_probs`). Other values: no filter.

    Rows with typical-p take the torch reference (the C++ kernel has no typical-p), every row on
    the same path whatever its batch-mates, so a row's token still depends on its own inputs only.

    The C++ kernel takes a row's exps once, finds the k-th largest with a k-element heap and the
    top-p cut by bucketing the weights by exponent and sorting only the bucket the cut falls in;
    the torch reference sorts (CUDA uses it)."""
    rows = logits.shape[0] if logits.dim() == 2 else -1
    if (logits.dim() != 2 or logits.dtype != torch.float32 or logits.shape[1] == 0
            or any(t.shape != (rows,) or t.dtype != torch.float32 or t.device != logits.device
                   for t in (inv_temperature, top_p, min_p, uniforms))
            or top_k.shape != (rows,) or top_k.dtype != torch.int64 or top_k.device != logits.device
            or (typical_p is not None and (typical_p.shape != (rows,) or typical_p.dtype != torch.float32
                                           or typical_p.device != logits.device))):
        raise ValueError(f"sample_filtered needs fp32 logits [rows, vocab], int64 top_k [rows] and fp32 [rows] "
                         f"temperatures, top_p, min_p, uniforms and typical_p on one device; got {tuple(logits.shape)} "
                         f"{logits.dtype}, top_k {tuple(top_k.shape)} {top_k.dtype}")
    if policy.reference or logits.is_cuda:
        return reference.sample_filtered(logits, inv_temperature, top_k, top_p, min_p, uniforms, typical_p)
    out = torch.empty(rows, dtype=torch.int64)
    if rows:
        if logits.stride(1) != 1:
            logits = logits.contiguous()
        cpu_ops().sample_filtered(out, logits, *(t.contiguous() for t in (inv_temperature, top_k, top_p, min_p,
                                                                          uniforms)))
    typical = None if typical_p is None else (typical_p < 1.0).nonzero().squeeze(1)
    if typical is not None and typical_p is not None and typical.numel():
        args = (t[typical] for t in (logits, inv_temperature, top_k, top_p, min_p, uniforms, typical_p))
        out[typical] = reference.sample_filtered(*args)
    return out
