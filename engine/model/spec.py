"""What the paged model reads from a Hugging Face config: one frozen record per architecture,
and the KV-cache geometry every size computation uses (the planner's too). Torch-free."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.model.moe_spec import MoEConfigError, MoESpec, moe_spec_from_hf_config

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "granite", "olmo2", "smollm3", "phi3", "gemma3_text",
                         "qwen2_moe", "qwen3_moe", "mixtral", "gpt_oss")
# a dense model type's config that names experts is refused (a Mixtral GGUF reads as mixtral: gguf_config)
_EXPERT_COUNTS = ("num_local_experts", "num_experts")
QK_NORMS = ("head", "projection")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # of the gated MLP's gate (layers.SwiGLU)


class UnsupportedModelError(ValueError):
    """The checkpoint is not a Llama-family decoder this engine can run."""


def kv_geometry(config: Any) -> tuple[int, int, int]:
    """`(layers, kv_heads, head_dim)` of any HF config object (attribute access)."""
    heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or int(config.hidden_size) // heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    return int(config.num_hidden_layers), kv_heads, head_dim


def lora_slot_elements(config: Any, max_lora_rank: int, tensor_parallel_size: int = 1) -> int:
    """Elements of one LoRA adapter slot (`engine.model.lora.manager.LoRAManager`) over a model of
    HF config `config`, on one rank of `tensor_parallel_size`: per layer, A `[slices x rank, in]`
    and B `[out, rank]` of the qkv (three slices), o, gate_up (two) and down projections, at rank
    max(2, `max_lora_rank`), each cut like its layer (`engine.model.lora.placement`: the split side
    of q/k/v and gate/up's B and of o and down's A; KV heads kept whole where they are replicated).
    The engine's slots and `pagedserve plan` both use it (an MoE model's sparse layers hold no MLP
    slots: for them it is an upper bound)."""
    layers, kv_heads, head_dim = kv_geometry(config)
    n = tensor_parallel_size
    hidden, inter = int(config.hidden_size), int(config.intermediate_size) // n
    q, kv = int(config.num_attention_heads) // n * head_dim, max(1, kv_heads // n) * head_dim
    per_rank = (3 * hidden + q + 2 * kv) + (q + hidden) + (2 * hidden + 2 * inter) + (inter + hidden)
    return layers * max(2, max_lora_rank) * per_rank


# KV cache dtypes: element bytes, and bytes of per-row scale (int8 rows end in their fp16 scale,
# ops/reference/kv_quant.py). The names are engine.config.KV_CACHE_DTYPES less "auto" (the model dtype).
KV_ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}
KV_SCALE_BYTES = {"int8": 2}


def kv_row_bytes(head_dim: int, kv_dtype: str) -> int:
    """Bytes of one (token, head) row of a cache of ``kv_dtype`` (a name of KV_ELEMENT_BYTES)."""
    return head_dim * KV_ELEMENT_BYTES[kv_dtype] + KV_SCALE_BYTES.get(kv_dtype, 0)


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int,
                       scale_bytes: int = 0) -> int:
    """One token's K and V over all layers: 2 x layers x kv_heads x (head_dim x dtype bytes + the
    row's scale bytes). The one size formula: the engine's pool and the planner both use it."""
    return 2 * num_layers * num_kv_heads * (head_dim * dtype_bytes + scale_bytes)


def kv_dtype_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, kv_dtype: str) -> int:
    """`kv_bytes_per_token` for a cache dtype name (float32, bfloat16, float16, int8)."""
    return kv_bytes_per_token(num_layers, num_kv_heads, head_dim, KV_ELEMENT_BYTES[kv_dtype],
                              KV_SCALE_BYTES.get(kv_dtype, 0))


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Shapes and options of a Llama-family decoder (Llama, Mistral, Qwen2, SmolLM; Qwen3, Granite,
    OLMo 2 and SmolLM3 through the fields after `sliding_window`, whose defaults are Llama's;
    Qwen2-MoE, Qwen3-MoE and Mixtral through `moe`, the sparse MLP of the layers it lists)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: dict[str, Any] = field(default_factory=dict)
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    sliding_window: int | None = None  # tokens a query of a sliding layer sees, itself included
    # per layer, whether it slides (`sliding_window`): Qwen2/3 and SmolLM3 by `layer_types`, Gemma 3's
    # local layers; None: every layer does when `sliding_window` is set (Mistral, Mixtral, Phi-3)
    window_layers: tuple[bool, ...] | None = None
    # RMSNorm of q and k before rotary: "head" over each head's head_dim (Qwen3), "projection" over
    # the whole q / k projection before the head split (OLMo 2); None: none (Llama)
    qk_norm: str | None = None
    post_norms: bool = False  # OLMo 2: RMSNorm of the attention and MLP outputs, no pre-norms
    embedding_multiplier: float = 1.0  # Granite: embeddings scaled by it
    attention_multiplier: float | None = None  # Granite: the softmax scale; None: head_dim ** -0.5
    residual_multiplier: float = 1.0  # Granite: each block's output scaled by it before the residual add
    logits_scaling: float = 1.0  # Granite: logits divided by it
    rope_layers: tuple[bool, ...] | None = None  # SmolLM3: per layer, whether rotary applies; None: every layer
    rotary_dim: int | None = None  # Phi-3 partial rotary: the rotated dims of a head (< head_dim); None: all
    fused_checkpoint: bool = False  # Phi-3: the checkpoint stores qkv_proj and gate_up_proj fused
    activation: str = "silu"  # the MLP gate's activation (Gemma 3: gelu_pytorch_tanh)
    norm_offset: float = 0.0  # Gemma 3: every RMSNorm scales by (offset + weight); folded into the weights at load
    sandwich_norms: bool = False  # Gemma 3: RMSNorm before and after attention and MLP
    local_rope: dict[str, Any] | None = None  # Gemma 3: the rope parameters of the `local_layers`
    local_layers: tuple[bool, ...] | None = None  # Gemma 3: per layer, whether it takes `local_rope`
    moe: MoESpec | None = None  # Qwen3-MoE, Mixtral: the sparse MLP of the layers `moe.sparse_layers` lists
    attention_sinks: bool = False  # gpt-oss: a learned logit per head joins each softmax denominator (`sinks`)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads {self.num_heads} is not a multiple of "
                f"num_key_value_heads {self.num_kv_heads}"
            )
        if self.qk_norm not in (None, *QK_NORMS):
            raise UnsupportedModelError(f"unknown qk_norm {self.qk_norm!r}; known: {', '.join(QK_NORMS)}")
        if self.activation not in ACTIVATIONS:
            raise UnsupportedModelError(f"unsupported activation {self.activation!r}; "
                                        f"supported: {', '.join(ACTIVATIONS)}")
        if self.local_layers is not None and (len(self.local_layers) != self.num_layers or self.local_rope is None):
            raise UnsupportedModelError(f"{len(self.local_layers)} per-layer local-rope flags for {self.num_layers} "
                                        "layers (or no local rope parameters)")
        if self.window_layers is not None and len(self.window_layers) != self.num_layers:
            raise UnsupportedModelError(f"{len(self.window_layers)} per-layer sliding-window flags for "
                                        f"{self.num_layers} layers")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise UnsupportedModelError(f"sliding_window must be >= 1 token, got {self.sliding_window}")
        if self.rope_layers is not None and len(self.rope_layers) != self.num_layers:
            raise UnsupportedModelError(f"{len(self.rope_layers)} per-layer rope flags for {self.num_layers} layers")
        if self.moe is not None and any(not 0 <= i < self.num_layers for i in self.moe.sparse_layers):
            raise UnsupportedModelError(f"sparse layers {self.moe.sparse_layers} outside 0..{self.num_layers - 1}")
        if self.logits_scaling <= 0:
            raise UnsupportedModelError(f"logits_scaling must be > 0, got {self.logits_scaling}")
        if self.rotary_dim is not None and not (0 < self.rotary_dim < self.head_dim and self.rotary_dim % 2 == 0
                                                and self.head_dim % 2 == 0 and self.qk_norm is None):
            raise UnsupportedModelError(f"partial rotary of {self.rotary_dim} of head_dim {self.head_dim} dims "
                                        "(an even count below an even head_dim, without q/k norms, is supported)")

    @property
    def llama_layout(self) -> bool:
        """No option beyond Llama/Mistral/Qwen2's: the layout the fused CPU decoder and the GGUF
        loader implement."""
        return (self.qk_norm is None and not self.post_norms and self.embedding_multiplier == 1.0
                and self.attention_multiplier is None and self.residual_multiplier == 1.0
                and self.logits_scaling == 1.0 and (self.rope_layers is None or all(self.rope_layers))
                and self.rotary_dim is None and not self.fused_checkpoint and self.activation == "silu"
                and self.norm_offset == 0.0 and not self.sandwich_norms and self.local_layers is None
                and self.moe is None)

    def is_sparse(self, layer: int) -> bool:
        """Whether decoder layer `layer`'s MLP is the sparse MoE block (`moe`)."""
        return self.moe is not None and self.moe.is_sparse(layer)

    def layer_window(self, layer: int) -> int:
        """The sliding window of decoder layer `layer` as the paged kernels take it: the tokens a
        query sees, itself included (transformers' sliding mask: key p is seen from query q when
        q - window < p <= q); 0 for full attention, also where the window spans the whole
        max_position_embeddings (then it never excludes a key)."""
        if self.sliding_window is None or self.sliding_window >= self.max_position_embeddings:
            return 0
        return self.sliding_window if self.window_layers is None or self.window_layers[layer] else 0

    @property
    def layer_windows(self) -> tuple[int, ...]:
        """`layer_window` of every decoder layer."""
        return tuple(self.layer_window(layer) for layer in range(self.num_layers))

    def exact_context(self) -> tuple[int, str] | None:
        """`(tokens, reason)`: the longest context served exactly when something bounds it below
        max_position_embeddings (longrope's switch to its long factors; a sliding window does not:
        the paged kernels apply it, `layer_window`); None when nothing does."""
        limits = []
        if self.rope.get("rope_type") == "longrope":
            rope_limit = int(self.rope["original_max_position_embeddings"])
            limits.append((rope_limit, f"longrope's original_max_position_embeddings {rope_limit} (past it the "
                                       "rotation of every position changes to the long factors)"))
        return min(limits) if limits else None

    def uses_local_rope(self, layer: int) -> bool:
        """Whether decoder layer `layer` rotates with `local_rope` (Gemma 3's sliding layers)."""
        return self.local_layers is not None and self.local_layers[layer]

    def uses_rope(self, layer: int) -> bool:
        """Whether rotary embedding applies in decoder layer `layer` (False: a NoPE layer)."""
        return self.rope_layers is None or self.rope_layers[layer]

    @classmethod
    def from_hf_config(cls, config: Any) -> ModelSpec:
        """Read a transformers `PretrainedConfig`; reject architectures we do not implement."""
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            archs = getattr(config, "architectures", None)
            raise UnsupportedModelError(
                f"unsupported model architecture {model_type!r} ({archs}); "
                f"supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        activation = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
        if activation not in ACTIVATIONS:
            raise UnsupportedModelError(f"unsupported activation {activation!r}; supported: {', '.join(ACTIVATIONS)}")
        try:
            moe = moe_spec_from_hf_config(config)
        except MoEConfigError as exc:
            raise UnsupportedModelError(f"{model_type}: {exc}") from exc
        experts = next((int(getattr(config, n)) for n in _EXPERT_COUNTS if getattr(config, n, None)), 0)
        if moe is None and experts > 0:
            raise UnsupportedModelError(f"model type {model_type!r} with {experts} experts: mixture-of-experts "
                                        "layers are served for qwen2_moe, qwen3_moe, mixtral and gpt_oss configs only")
        num_layers, num_kv_heads, head_dim = kv_geometry(config)
        attention_bias = bool(getattr(config, "attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=num_layers,
            num_heads=config.num_attention_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(config.rms_norm_eps),
            max_position_embeddings=config.max_position_embeddings,
            rope=_rope_parameters(config),
            qkv_bias=attention_bias or model_type == "qwen2" or (model_type == "qwen2_moe" and bool(config.qkv_bias)),
            o_bias=attention_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            sliding_window=_sliding_window(config),
            window_layers=_window_layers(config),
            activation=activation,
            moe=moe,
            **_family_options(config),
        )


def _family_options(config: Any) -> dict[str, Any]:
    """The ModelSpec fields past Llama's that `config.model_type` sets, read as transformers'
    modeling code of that family uses them."""
    model_type = config.model_type
    if model_type in ("qwen3", "qwen3_moe"):
        return {"qk_norm": "head"}
    if model_type == "olmo2":
        return {"qk_norm": "projection", "post_norms": True}
    if model_type == "granite":
        return {"embedding_multiplier": float(config.embedding_multiplier),
                "attention_multiplier": float(config.attention_multiplier),
                "residual_multiplier": float(config.residual_multiplier),
                "logits_scaling": float(config.logits_scaling)}
    if model_type == "smollm3":  # no_rope_layers[i]: 1 = layer i applies rotary, 0 = a NoPE layer
        return {"rope_layers": tuple(bool(flag) for flag in config.no_rope_layers)}
    if model_type == "gemma3_text":
        return _gemma3_options(config)
    if model_type == "gpt_oss":  # q/k/v/o biases come from attention_bias; the MoE block from moe_spec
        return {"attention_sinks": True}
    if model_type == "phi3":
        params = getattr(config, "rope_parameters", None) or {}
        factor = float(params.get("partial_rotary_factor") or getattr(config, "partial_rotary_factor", 1.0) or 1.0)
        head_dim = kv_geometry(config)[2]
        rotary_dim = int(head_dim * factor)
        return {"rotary_dim": rotary_dim if rotary_dim < head_dim else None, "fused_checkpoint": True}
    return {}


def _gemma3_options(config: Any) -> dict[str, Any]:
    """Gemma 3 text: (1 + w) norms before and after each block, q/k norms over head_dim, embeddings
    times sqrt(hidden), softmax scale query_pre_attn_scalar^-0.5, the sliding layers' own rope."""
    for name in ("final_logit_softcapping", "attn_logit_softcapping"):
        if getattr(config, name, None) is not None:
            raise UnsupportedModelError(f"gemma3_text with {name} {getattr(config, name)} is not supported")
    if getattr(config, "use_bidirectional_attention", False):
        raise UnsupportedModelError("gemma3_text with use_bidirectional_attention is not supported (causal only)")
    layer_types = list(config.layer_types)
    return {"qk_norm": "head", "norm_offset": 1.0, "sandwich_norms": True,
            "embedding_multiplier": float(config.hidden_size) ** 0.5,
            "attention_multiplier": float(config.query_pre_attn_scalar) ** -0.5,
            "local_rope": _rope_parameters(config, "sliding_attention"),
            "local_layers": tuple(kind == "sliding_attention" for kind in layer_types)}


def _rope_parameters(config: Any, layer_type: str = "full_attention") -> dict[str, Any]:
    """`rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling` (transformers 4); those
    of `layer_type` where they are given per layer type (Gemma 3)."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    if isinstance(params.get(layer_type), dict):
        params = dict(params[layer_type])
    params.setdefault("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    params.setdefault("original_max_position_embeddings",
                      getattr(config, "original_max_position_embeddings", None) or config.max_position_embeddings)
    return params


# Families whose sliding window is switched by `use_sliding_window` and applies to the layers
# `layer_types` marks "sliding_attention" (transformers' modeling code); the others (Mistral)
# apply `sliding_window`, when set, to every layer.
_LAYER_TYPED_WINDOW = ("qwen2", "qwen2_moe", "qwen3", "smollm3")
_LAYER_TYPED_ONLY = ("gemma3_text", "gpt_oss")  # no use_sliding_window switch: layer_types alone says


def _sliding_window(config: Any) -> int | None:
    """The window (tokens a query sees, itself included) of the model's sliding layers; None
    when no layer slides."""
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    if config.model_type in _LAYER_TYPED_ONLY:  # no switch: the layers layer_types marks slide
        return int(window) if "sliding_attention" in (getattr(config, "layer_types", None) or []) else None
    if config.model_type in _LAYER_TYPED_WINDOW:
        if not getattr(config, "use_sliding_window", False):
            return None
        layer_types = getattr(config, "layer_types", None)
        if layer_types is not None and "sliding_attention" not in layer_types:
            return None
    return int(window)


def _window_layers(config: Any) -> tuple[bool, ...] | None:
    """Per layer, whether it slides, for the families whose layers differ (transformers' modeling
    code: `layer_types[i] == "sliding_attention"`; without `layer_types` Qwen2's layers from
    `max_window_layers` on); None where every layer takes `sliding_window` (or none is set)."""
    if _sliding_window(config) is None or config.model_type not in (*_LAYER_TYPED_WINDOW, *_LAYER_TYPED_ONLY):
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        first = int(getattr(config, "max_window_layers", 0) or 0)
        return tuple(i >= first for i in range(int(config.num_hidden_layers)))
    return tuple(kind == "sliding_attention" for kind in layer_types)
