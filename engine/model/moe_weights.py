"""Checkpoint tensors of a sparse MoE block into `SparseMoE`'s stacked parameters.

Names are relative to the block (`model.layers.3.mlp.`, or Mixtral's `model.layers.3.block_sparse_moe.`, stripped
by the caller). Accepted forms:
- per expert, as transformers 5 `save_pretrained` writes them and the Hub ships them:
  `experts.{e}.gate_proj|up_proj|down_proj.weight` (Qwen) or `experts.{e}.w1|w3|w2.weight` (Mixtral);
- stacked, as transformers 5 holds them in memory: `experts.gate_up_proj [E, 2I, H]`,
  `experts.down_proj [E, H, I]`; gpt-oss's own layout, `experts.gate_up_proj [E, H, 2I]` with gate and
  up interleaved column by column, `experts.down_proj [E, I, H]`, and their biases;
- the router `gate.weight` (`router.weight`, `router.bias` for gpt-oss) and Qwen2-MoE's
  `shared_expert.gate_proj|up_proj|down_proj.weight`, `shared_expert_gate.weight`.

Under tensor parallelism the tensors come cut to the rank's slice (`TPShard.weight_slice`), except
Qwen's stacked `experts.gate_up_proj [E, 2I, H]`, whose rank rows (gate, then up) are two ranges:
it comes whole and is cut here.
"""

from __future__ import annotations

import re

import torch
from torch import Tensor

from engine.model.moe import Experts, SparseMoE
from engine.model.moe_spec import CLAMPED_SWIGLU

_PER_EXPERT = re.compile(r"^experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_PART = {"gate_proj": 0, "w1": 0, "up_proj": 1, "w3": 1, "down_proj": 2, "w2": 2}
_STACKED = {"experts.gate_up_proj": (0, 1), "experts.down_proj": (2,)}  # stacked tensor -> pieces of each expert
_SHARED = re.compile(r"^shared_expert\.(gate_proj|up_proj|down_proj)\.weight$")


def _copy(dest: Tensor, src: Tensor, name: str) -> None:
    if dest.shape != src.shape:
        raise ValueError(f"shape mismatch for {name!r}: checkpoint {tuple(src.shape)}, model {tuple(dest.shape)}")
    dest.copy_(src)


def _deinterleave(t: Tensor) -> Tensor:
    """gpt-oss's `[..., 2I]` gate/up columns interleaved -> `[..., 2I]` gate columns then up columns."""
    return t.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


def _rank_gate_up(moe: SparseMoE, tensor: Tensor) -> Tensor:
    """This rank's gate rows then up rows of a whole stacked `[E, 2I, H]` (the tensor itself at size 1
    or when it is already this rank's)."""
    full, local = moe.full_spec.intermediate_size, moe.spec.intermediate_size
    if full == local or tensor.dim() != 3 or tensor.shape[1] != 2 * full:
        return tensor
    start = moe.shard.rank * local
    return torch.cat([tensor.narrow(1, start, local), tensor.narrow(1, full + start, local)], dim=1)


def load_moe_tensor(moe: SparseMoE, name: str, tensor: Tensor) -> set[str]:
    """Copy one checkpoint tensor into `moe`; returns the pieces it filled (of `expected_moe_pieces`).
    Raises KeyError for a name with no place in the block, ValueError on a shape mismatch."""
    if name.startswith("router."):  # gpt-oss
        name = "gate." + name.removeprefix("router.")
    experts, size = moe.experts, moe.spec.intermediate_size
    gpt_oss = moe.spec.activation == CLAMPED_SWIGLU
    per_expert = _PER_EXPERT.match(name)
    if per_expert is not None:
        e, part = int(per_expert.group(1)), _PART[per_expert.group(2)]
        if e >= moe.spec.num_experts:
            raise KeyError(f"checkpoint tensor {name!r}: expert {e} of {moe.spec.num_experts}")
        dest = experts.down_proj[e] if part == 2 else experts.gate_up_proj[e].narrow(0, part * size, size)
        _copy(dest, tensor, name)
        return {f"experts.{e}.{part}"}
    shared = _SHARED.match(name)
    if shared is not None and moe.shared_expert is not None:
        part = ("gate_proj", "up_proj", "down_proj").index(shared.group(1))
        s = moe.spec.shared_expert_size
        dest = (moe.shared_expert.down_proj.weight if part == 2
                else moe.shared_expert.gate_up_proj.weight.narrow(0, part * s, s))
        _copy(dest, tensor, name)
        return {f"shared_expert.{part}"}
    if gpt_oss and name in ("experts.gate_up_proj", "experts.down_proj"):
        tensor = _deinterleave(tensor).transpose(1, 2) if name == "experts.gate_up_proj" else tensor.transpose(1, 2)
    elif gpt_oss and name == "experts.gate_up_proj_bias":
        tensor = _deinterleave(tensor)
    elif name == "experts.gate_up_proj":
        tensor = _rank_gate_up(moe, tensor)
    params = dict(moe.named_parameters())
    if name not in params:
        raise KeyError(f"checkpoint tensor {name!r} has no place in the MoE block")
    _copy(params[name].data, tensor, name)
    if name in _STACKED:
        return {f"experts.{e}.{p}" for e in range(moe.spec.num_experts) for p in _STACKED[name]}
    return {name}


def expected_moe_pieces(moe: SparseMoE) -> set[str]:
    """Every piece `load_moe_tensor` must fill before the block is complete (packed experts came with
    their weights: only their biases are loaded)."""
    pieces = {f"experts.{e}.{p}" for e in range(moe.spec.num_experts) for p in range(3)} \
        if isinstance(moe.experts, Experts) else set()
    pieces |= {n for n, _ in moe.named_parameters() if n not in _STACKED and not n.startswith("shared_expert.")}
    if moe.shared_expert is not None:
        pieces |= {f"shared_expert.{p}" for p in range(3)}
    return pieces
