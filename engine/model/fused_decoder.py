"""The decoder layers in one C++ call where the model allows it (`ops.llama_decoder`).

A one-row decode step of SmolLM2 on its Q4_1 weights makes ~300 module calls and ~600 op calls
from Python, each a few microseconds: longer than the step's kernels once they read the eight-row
layout (profile with `benchmarks/kernels/quant_bench.py --batches 1`). `FusedDecoder` hands the same
kernels the same tensors in the same order from C++ (csrc/cpu/decoder.cpp), so a step's hidden
states are bit for bit those of the module path (tests/engine/model/test_fused_decoder.py and
test_fused_moe_decoder.py compare them).

It serves CPU models whose every dense decoder linear is a packed `QuantLinear` (one shard or
several: llama.cpp's Q4_K_M mix stores a layer's V in another format than its Q and K) without
tensor parallelism, for steps of at most `QUANT_GEMV_MAX_ROWS` tokens over a real KV cache (the
kernel's range: longer prefills go through oneDNN, where Python's share is small): Llama's layer,
with Qwen3's per-head q/k RMSNorm, and sparse MoE MLPs (Qwen3-MoE, Qwen2-MoE with its gated shared
expert, Mixtral; beside dense layers where the config mixes them) whose experts are `PackedExperts`
with the SwiGLU activation and no expert biases. Anything else (fp32 experts, gpt-oss's attention
sinks and clamped experts, q/k norm over the whole projection, the other layer options of
`ModelSpec`) runs the modules. Steps with LoRA rows run fused too where every adapter slot is fp32
(the CPU kernel `ops.lora.lora_rows`, which the modules call on the same tensors in the same order).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

import ops
from engine.model.attention import AttentionMetadata
from engine.model.layers import SwiGLU
from engine.model.moe import RouterLinear, SparseMoE
from engine.model.moe_spec import SILU, SOFTMAX_TOPK
from engine.model.packed_experts import PackedExperts
from engine.model.quant_linear import QuantLinear
from engine.model.spec import ModelSpec
from ops.build import cpu_ops
from ops.moe import MOE_SOFTMAX_TOPK, MOE_TOPK_SOFTMAX
from ops.policy import FASTEST, OpsPolicy
from ops.quant import QUANT_GEMV_MAX_ROWS

if TYPE_CHECKING:
    from engine.model.lora.slots import LoRASlots

_NONE = torch.empty(0)  # "no bias" in the op's tensor list
_NO_TABLES = torch.empty(0, dtype=torch.int32)  # a decode-only step's prefill tensors


class FusedDecoder:
    """The decoder layers' weights as the flat lists `ops.llama_decoder` takes. `layers` are
    `engine.model.llama.LlamaDecoderLayer`s (typed loosely: that module builds this one)."""

    def __init__(self, layers: Sequence[Any]) -> None:
        attn = layers[0].self_attn
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.scale = attn.attn.scale
        self.eps = layers[0].input_layernorm.eps
        self.linears: list[QuantLinear | None] = []  # 4 per layer; an MoE layer's shared expert may be absent
        self.norm_weights: list[Tensor] = []
        self.qk_norms: list[Tensor] = []  # q, k weights per layer (Qwen3), or none
        self.moe_layers: list[int] = []  # per layer: 1 where its MLP is a sparse MoE block
        self.moe_tensors: list[Tensor] = []
        self._moe_config: list[tuple[list[int], PackedExperts, list[int]]] = []  # int8 flag read per call
        for layer in layers:
            mlp = layer.mlp
            shared = mlp.shared_expert if isinstance(mlp, SparseMoE) else mlp
            mlp_linears = (None, None) if shared is None else (shared.gate_up_proj, shared.down_proj)
            for module in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, *mlp_linears):
                assert module is None or isinstance(module, QuantLinear)
                self.linears.append(module)
            self.norm_weights += [layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach()]
            if layer.self_attn.qk_norm == "head":
                self.qk_norms += [layer.self_attn.q_norm.weight.detach(), layer.self_attn.k_norm.weight.detach()]
            self.moe_layers.append(int(isinstance(mlp, SparseMoE)))
            if isinstance(mlp, SparseMoE):
                self._add_moe(mlp)
        shards = [[] if m is None else m.shards() for m in self.linears]
        self.qweights = [t for parts in shards for _, t in parts]
        self.formats = [fmt.type_id for parts in shards for fmt, _ in parts]  # type: ignore[union-attr]
        self.shard_counts = [len(parts) for parts in shards]
        self.biases = [_NONE if m is None or m.bias is None else m.bias.detach() for m in self.linears]
        self.windows = [layer.self_attn.attn.window for layer in layers]  # sliding windows (0: none)
        self._lora_slots: list[LoRASlots | None] | None = None  # what `_lora` was made from
        self._lora: tuple[list[Tensor], list[Tensor], list[int]] | None = None

    def _add_moe(self, block: SparseMoE) -> None:
        """`block`'s tensors and settings in `ops.llama_decoder`'s MoE lists (csrc/cpu/ops.h)."""
        experts = block.experts
        assert isinstance(experts, PackedExperts)
        *gate_up, (down_fmt, down) = experts.shards()
        gate = block.shared_expert_gate
        self.moe_tensors += [_fixed(block.gate), _NONE if block.gate.bias is None else block.gate.bias.detach(),
                             _NONE if gate is None else _fixed(gate), down, *[t for _, t in gate_up]]
        spec = block.spec
        router = MOE_SOFTMAX_TOPK if spec.router == SOFTMAX_TOPK else MOE_TOPK_SOFTMAX
        self._moe_config.append(([spec.top_k, router, int(spec.norm_topk_prob)], experts,
                                 [down_fmt.type_id, len(gate_up), *[f.type_id for f, _ in gate_up]]))

    @staticmethod
    def serves(spec: ModelSpec) -> bool:
        """Whether `spec`'s layer is one the C++ decoder implements: Llama's (`ModelSpec.llama_layout`),
        optionally with per-head q/k RMSNorm (Qwen3) and sparse MoE MLPs (their blocks: `for_layers`)."""
        if spec.attention_sinks or spec.qk_norm not in (None, "head"):
            return False
        if spec.moe is not None and (spec.moe.activation != SILU or spec.moe.expert_bias):
            return False  # gpt-oss's experts
        return dataclasses.replace(spec, qk_norm=None, moe=None).llama_layout

    @staticmethod
    def for_layers(layers: Sequence[Any], tp_size: int) -> FusedDecoder | None:
        """A fused decoder for a model's decoder `layers` (at tensor-parallel size `tp_size`), or None
        where it does not apply (module docstring)."""
        if tp_size != 1 or not layers:
            return None
        qk_norm = layers[0].self_attn.qk_norm
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            if attn.qk_norm != qk_norm or qk_norm not in (None, "head") or not attn.use_rope or layer.local_rope:
                return None
            if isinstance(mlp, SparseMoE):
                if not _packed_block(mlp):
                    return None
                shared = mlp.shared_expert
            elif isinstance(mlp, SwiGLU) and mlp.activation == "silu":
                shared = mlp
            else:
                return None
            linears = [attn.qkv_proj, attn.o_proj, *(() if shared is None else (shared.gate_up_proj, shared.down_proj))]
            if not all(isinstance(m, QuantLinear) and all(f is not None and t.is_cpu for f, t in m.shards())
                       for m in linears):
                return None
            if ops.quant.amx_bf16() and any(f.name not in ops.quant.BF16_FORMATS for m in linears for f in m.formats):
                return None  # its bf16 steps would call the AMX kernel on a format it has no panels for
            eps = {layer.input_layernorm.eps, layer.post_attention_layernorm.eps}
            if qk_norm is not None:
                eps |= {attn.q_norm.eps, attn.k_norm.eps}
            if eps != {layers[0].input_layernorm.eps}:
                return None
        return FusedDecoder(layers)

    @staticmethod
    def applies(hidden: Tensor, kv_caches: list[tuple[Tensor, Tensor]], meta: AttentionMetadata,
                bf16_linears: bool = False, policy: OpsPolicy = FASTEST) -> bool:
        """Whether this step can run fused: CPU fp32 activations, at most `QUANT_GEMV_MAX_ROWS`
        tokens (any number with `bf16_linears` on the AMX kernel), a real cache (a profiling pass
        has none), the compiled kernels selected (`policy`); under `policy.fixed_order` decode-only steps."""
        rows = hidden.shape[0]
        if meta.num_prefills and policy.fixed_order:  # prefill attention must take decode's per-row path
            return False  # (ops/attention_rows.py), which the C++ decoder's prefill call does not
        if meta.exact_ranges is not None:  # exact rows that are not the leading ones: the module path
            return False
        if not (0 < rows <= QUANT_GEMV_MAX_ROWS or (rows > 0 and bf16_linears and ops.quant.bf16_kernel() is not None)):
            return False
        return (hidden.is_cpu and hidden.dtype == torch.float32
                and bool(kv_caches) and kv_caches[0][0].numel() > 0 and not policy.reference)

    def lora_lists(self) -> tuple[list[Tensor], list[Tensor], list[int]] | None:
        """The linears' adapter slots (`QuantLinear.lora`, attached after the model is built) as
        `ops.llama_decoder`'s LoRA lists: per linear its stacked A (numel 0: none), then every
        slice's B, and per linear its slice count; None where a slot is not fp32 on the CPU (the
        modules then add the products on the torch path)."""
        current = [None if m is None else m.lora for m in self.linears]
        if self._lora_slots is None or any(x is not y for x, y in zip(self._lora_slots, current, strict=True)):
            self._lora_slots = current
            slots = [s for s in current if s is not None]
            fp32 = all(t.dtype == torch.float32 and t.is_cpu for s in slots for t in (s.a, *s.b))
            self._lora = ([_NONE if s is None else s.a for s in current], [t for s in slots for t in s.b],
                          [0 if s is None else len(s.b) for s in current]) if fp32 else None
        return self._lora

    def __call__(self, hidden: Tensor, rope: tuple[Tensor, Tensor], kv_caches: list[tuple[Tensor, Tensor]],
                 meta: AttentionMetadata, exact_rows: int, bf16_linears: bool = False,
                 lora: tuple[list[Tensor], list[Tensor], list[int]] | None = None) -> tuple[Tensor, Tensor]:
        """`(last layer's MLP output, residual stream)` for the final norm; `hidden` (the
        embeddings, owned by the caller) is overwritten. Rows [0, exact_rows) keep fp32
        activations (`LinearRows.exact_rows` on the module path); with `bf16_linears` every linear
        computes in bf16 (`LinearRows.bf16`). `lora` (`lora_lists`): the linears add the adapter
        products of the rows `meta.lora_slots` gives a slot."""
        positions, cos_sin = rope
        residual = torch.empty_like(hidden)
        prefill = meta.num_prefills > 0
        lora_slots = None if lora is None else meta.lora_slots
        lora_a, lora_b, lora_slices = ([], [], []) if lora_slots is None or lora is None else lora
        out = cpu_ops().llama_decoder(
            hidden.contiguous(), residual, positions.contiguous(), cos_sin, meta.slot_mapping.contiguous(),
            [k for k, _ in kv_caches], [v for _, v in kv_caches], meta.num_prefill_tokens, exact_rows,
            meta.prefill_block_tables.contiguous() if prefill else _NO_TABLES,
            meta.prefill_query_start_loc if prefill else _NO_TABLES,
            meta.prefill_context_lens_tensor if prefill else _NO_TABLES,
            meta.decode_block_tables.contiguous(), meta.decode_context_lens.contiguous(),
            self.norm_weights, self.qweights, self.biases, self.formats,
            [int(m is not None and m.int8_activations) for m in self.linears],
            self.num_heads, self.num_kv_heads, self.head_dim, self.eps, self.scale, bf16_linears, self.windows,
            self.shard_counts, self.qk_norms, self.moe_layers if self._moe_config else [], self.moe_tensors,
            [v for head, experts, tail in self._moe_config for v in (*head, int(experts.int8_activations), *tail)],
            lora_slots, lora_a, lora_b, lora_slices)
        return out, residual


def _fixed(router: RouterLinear) -> Tensor:
    """`router`'s `fixed_gemm` panels, made as its own forward makes them (and kept there)."""
    if router.fixed is None or router.fixed.shape[1] != router.in_features:
        router.fixed = ops.pack_fixed(router.weight)
    return router.fixed


def _packed_block(block: SparseMoE) -> bool:
    """Whether the C++ decoder implements `block`: packed CPU experts with SwiGLU and no biases, fp32
    routers on the CPU (`RouterLinear`), a shared expert (if any) behind a bias-free one-row gate."""
    spec, experts, gate = block.spec, block.experts, block.shared_expert_gate
    if not isinstance(experts, PackedExperts) or spec.activation != SILU or spec.expert_bias:
        return False
    if not all(t.is_cpu for _, t in experts.shards()):
        return False
    routers = [block.gate] if gate is None else [block.gate, gate]
    if not all(isinstance(r, RouterLinear) and r.weight.is_cpu and r.weight.dtype == torch.float32 for r in routers):
        return False
    shared = block.shared_expert
    return (shared is None) == (gate is None) and (gate is None or gate.bias is None) and \
        (shared is None or shared.activation == "silu")
