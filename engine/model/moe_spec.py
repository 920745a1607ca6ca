"""What a sparse mixture-of-experts block reads from a Hugging Face config (Qwen2-MoE, Qwen3-MoE,
Mixtral, gpt-oss): one frozen record, and the parse from a config. Torch-free (the planner and
`engine.model.spec` import it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MOE_MODEL_TYPES = ("qwen2_moe", "qwen3_moe", "mixtral", "gpt_oss")

# How the router turns logits into each token's top-k experts and their weights (transformers' order):
SOFTMAX_TOPK = "softmax_topk"  # fp32 softmax over all experts, top-k, renormalised iff norm_topk_prob
TOPK_SOFTMAX = "topk_softmax"  # top-k of the logits, softmax over those k (gpt-oss)
ROUTERS = (SOFTMAX_TOPK, TOPK_SOFTMAX)

SILU = "silu"  # silu(gate) * up
CLAMPED_SWIGLU = "clamped_swiglu"  # gpt-oss: (clamp(up, ±limit) + 1) * g * sigmoid(alpha g), g = min(gate, limit)
ACTIVATIONS = (SILU, CLAMPED_SWIGLU)


class MoEConfigError(ValueError):
    """The config's MoE fields are missing or inconsistent (message names the field)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class MoESpec:
    """Shapes and routing of one model's sparse MoE blocks (every sparse layer has the same).

    `sparse_layers` lists the decoder layers whose MLP is the MoE block; the others keep the dense
    MLP of `ModelSpec.intermediate_size`. `shared_expert_size` > 0 adds Qwen2-MoE's shared expert,
    scaled by `sigmoid(shared_expert_gate(x))`. `weights_in_model_dtype`: the routing weights are cast
    to the activations' dtype before they scale an expert's output (Qwen, gpt-oss), else the product is taken
    in fp32 and then cast (Mixtral)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    sparse_layers: tuple[int, ...]
    norm_topk_prob: bool = True
    router: str = SOFTMAX_TOPK
    router_bias: bool = False
    expert_bias: bool = False
    activation: str = SILU
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    shared_expert_size: int = 0
    weights_in_model_dtype: bool = True

    def __post_init__(self) -> None:
        if self.num_experts < 1 or not 1 <= self.top_k <= self.num_experts:
            raise MoEConfigError(f"num_experts_per_tok {self.top_k} must be in 1..num_experts ({self.num_experts})")
        if self.intermediate_size < 1:
            raise MoEConfigError(f"expert intermediate size must be positive; got {self.intermediate_size}")
        if self.router not in ROUTERS or self.activation not in ACTIVATIONS:
            raise MoEConfigError(f"unknown router {self.router!r} or activation {self.activation!r}")

    def is_sparse(self, layer: int) -> bool:
        return layer in self.sparse_layers


def _int(config: Any, *names: str) -> int:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return int(value)
    raise MoEConfigError(f"{config.model_type} config lacks {' / '.join(names)}")


def moe_spec_from_hf_config(config: Any) -> MoESpec | None:
    """The MoE record of a transformers config (attribute access), or None for a dense model type."""
    model_type = getattr(config, "model_type", None)
    if model_type not in MOE_MODEL_TYPES:
        return None
    layers = int(config.num_hidden_layers)
    top_k = _int(config, "num_experts_per_tok")
    if model_type in ("qwen2_moe", "qwen3_moe"):
        experts = _int(config, "num_experts", "num_local_experts")
        step = _int(config, "decoder_sparse_step")
        dense = {int(i) for i in (getattr(config, "mlp_only_layers", None) or [])}
        sparse = tuple(i for i in range(layers) if i not in dense and step > 0 and (i + 1) % step == 0)
        shared = _int(config, "shared_expert_intermediate_size") if model_type == "qwen2_moe" else 0
        return MoESpec(num_experts=experts, top_k=top_k, intermediate_size=_int(config, "moe_intermediate_size"),
                       sparse_layers=sparse,
                       norm_topk_prob=bool(getattr(config, "norm_topk_prob", False)), shared_expert_size=shared)
    experts = _int(config, "num_local_experts", "num_experts")
    if model_type == "mixtral":
        return MoESpec(num_experts=experts, top_k=top_k, intermediate_size=_int(config, "intermediate_size"),
                       sparse_layers=tuple(range(layers)),
                       norm_topk_prob=True, weights_in_model_dtype=False)
    return MoESpec(num_experts=experts, top_k=top_k, intermediate_size=_int(config, "intermediate_size"),
                   sparse_layers=tuple(range(layers)),  # gpt_oss
                   norm_topk_prob=False, router=TOPK_SOFTMAX, router_bias=True, expert_bias=True,
                   activation=CLAMPED_SWIGLU, swiglu_alpha=float(getattr(config, "swiglu_alpha", 1.702)),
                   swiglu_limit=float(getattr(config, "swiglu_limit", 7.0)))
