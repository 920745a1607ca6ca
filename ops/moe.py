"""``packed_moe_experts``: a sparse MoE block's packed experts in one C++ call (csrc/cpu/packed_moe.cpp);
``moe_route``: its router's softmax / top-k in one call.

The router's choices in, the block's routed output out, bit for bit
``engine.model.packed_experts.PackedExperts.forward`` on ``engine.model.moe.group_by_expert``'s pairs:
the same kernels (``quant_linear`` per expert and shard, ``silu_and_mul`` or the ATen ops of the clamped
SwiGLU) in the same order, the same sums. CPU fp32 only; the caller keeps its Python path elsewhere.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import torch

from ops.build import cpu_ops
from ops.quant import QuantFormat

MOE_SOFTMAX_TOPK = 0  # csrc/cpu/ops.h kMoESoftmaxTopk: fp32 softmax, top-k, renormalised iff asked
MOE_TOPK_SOFTMAX = 1  # kMoETopkSoftmax: top-k of the logits, softmax over those k
MOE_SILU = 0  # csrc/cpu/ops.h kMoESilu
MOE_CLAMPED_SWIGLU = 1  # kMoEClampedSwiglu: gpt-oss's (clamp(up, ±limit) + 1) * g * sigmoid(alpha g)


@cache
def _op() -> Any:
    """The op's overload, resolved once (a packet call resolves it each time)."""
    return cpu_ops().packed_moe_experts.default


@cache
def _route_op() -> Any:
    return cpu_ops().moe_route.default


def moe_route(logits: torch.Tensor, top_k: int, router: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights, experts [T, k] int64)`` of CPU router ``logits [T, E]`` in one call, on the ATen ops (and
    so the bits) of ``engine.model.moe.SparseMoE.route``: ``MOE_SOFTMAX_TOPK`` or ``MOE_TOPK_SOFTMAX``."""
    weights, experts = _route_op()(logits, top_k, router, norm_topk_prob)
    return weights, experts


def packed_moe_experts(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                       gate_up: list[tuple[QuantFormat, torch.Tensor]], down: tuple[QuantFormat, torch.Tensor],
                       exact_mask: torch.Tensor | None, int8_activations: bool, activation: int,
                       alpha: float = 0.0, limit: float = 0.0, gate_up_bias: torch.Tensor | None = None,
                       down_bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 CPU ``x [T, H]``, the router's ``experts`` (int64) and ``weights`` (fp32) ``[T, k]`` -> ``[T, H]``:
    each token's sum, in ascending expert order, of weight x expert(x). ``gate_up``: the validated shards
    ``[E, rows, row_bytes]`` (gate rows then up rows), ``down`` ``[E, H, row_bytes]``; ``exact_mask`` ``[T]``:
    the rows kept on fp32 activations under ``int8_activations``; biases ``[E, 2I]``, ``[E, H]``."""
    return _op()(x, experts, weights, [t for _, t in gate_up], [f.type_id for f, _ in gate_up], down[1],
                 down[0].type_id, exact_mask, int8_activations, activation, alpha, limit, gate_up_bias, down_bias)
