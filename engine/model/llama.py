"""Llama-family decoder (Llama, Mistral, Qwen2, SmolLM; Qwen3, Granite, OLMo 2, SmolLM3 through
`ModelSpec`'s options; Qwen3-MoE and Mixtral with `SparseMoE` as the MLP of their sparse layers)
on the paged KV cache.

Parameter names follow the HF checkpoints except for the fused `qkv_proj` and `gate_up_proj`,
whose shards are stacked at load time by `load_weights`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

import ops
from engine.model.attention import AttentionMetadata, PagedAttention
from engine.model.execution_policy import PLAIN_ROWS, ExecutionPolicy, LinearRows
from engine.model.fused_decoder import FusedDecoder
from engine.model.layers import Linear, RMSNorm, SwiGLU, VocabParallelEmbedding
from engine.model.logit_screen import LogitScreen
from engine.model.lora.slots import LoRARows
from engine.model.moe import SparseMoE
from engine.model.moe_weights import expected_moe_pieces, load_moe_tensor
from engine.model.quant_linear import QuantLinear
from engine.model.quant_screen import QuantLogitScreen
from engine.model.rope import RotaryEmbedding, partial_rotary_order
from engine.model.sharding import SINGLE, TPShard
from engine.model.spec import ModelSpec, UnsupportedModelError
from ops.policy import FASTEST, OpsPolicy


def _mlp(spec: ModelSpec, shard: TPShard, layer: int) -> nn.Module:
    """Decoder layer `layer`'s MLP: the sparse MoE block where `spec.is_sparse(layer)`, else the dense SwiGLU."""
    if spec.moe is not None and spec.is_sparse(layer):
        return SparseMoE(spec.moe, spec.hidden_size, shard)
    return SwiGLU(spec.hidden_size, shard.local_intermediate(spec), spec.mlp_bias, shard, spec.activation)


# the sparse MLP's checkpoint names (Mixtral's Hub files and transformers' save_pretrained) -> the module's
_MOE_NAMES = {"block_sparse_moe": "mlp"}

# HF shard name -> (fused parameter, shard index)
_STACKED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


class LlamaAttention(nn.Module):
    """Fused QKV projection, RoPE fused with the K/V cache write, paged attention, output projection;
    GQA when kv heads < heads. Under tensor parallelism this rank's heads only (`TPShard`), the
    output projection's partial sums all-reduced. Options of `ModelSpec`: q/k RMSNorm before
    rotary (`qk_norm`), the softmax scale (`attention_multiplier`), no rotary in a NoPE layer
    (`use_rope` False: k and v go to the cache as they are), a sliding `window` (`ModelSpec.layer_window`)."""

    def __init__(self, spec: ModelSpec, shard: TPShard = SINGLE, use_rope: bool = True, window: int = 0) -> None:
        super().__init__()
        local = shard.kv_spec(spec)
        self.head_dim, self.num_heads, self.num_kv_heads = spec.head_dim, local.num_heads, local.num_kv_heads
        q_size, kv_size = local.num_heads * spec.head_dim, local.num_kv_heads * spec.head_dim
        self.qkv_proj = Linear(spec.hidden_size, q_size + 2 * kv_size, bias=spec.qkv_bias)
        self.o_proj = Linear(q_size, spec.hidden_size, bias=spec.o_bias and shard.rank == 0)
        scale = spec.head_dim**-0.5 if spec.attention_multiplier is None else spec.attention_multiplier
        self.attn = PagedAttention(local.num_heads, local.num_kv_heads, spec.head_dim, scale, window)
        self.qk_norm = spec.qk_norm
        if spec.qk_norm is not None:  # "head": weights [head_dim]; "projection": [q_size] and [kv_size]
            per_head = spec.qk_norm == "head"
            self.q_norm = RMSNorm(spec.head_dim if per_head else q_size, spec.rms_norm_eps)
            self.k_norm = RMSNorm(spec.head_dim if per_head else kv_size, spec.rms_norm_eps)
        self.use_rope = use_rope
        self.shard = shard

    def forward(self, rope: tuple[Tensor, Tensor], hidden: Tensor, kv_cache: tuple[Tensor, Tensor],
                meta: AttentionMetadata, rows: LinearRows = PLAIN_ROWS) -> Tensor:
        """`rope` is `(positions [T], cos/sin table)`; q and k are rotated in place inside the qkv
        output, and k, v land in the cache in the same pass. `rows`: the step's arithmetic in the linears
        and, through `rows.ops`, in every op."""
        policy = rows.ops
        q, k, v = self._qkv(self.qkv_proj(hidden, rows), policy)
        positions, cos_sin = rope
        if self.use_rope:
            ops.rotary_embedding_and_cache(positions, q, k, v, cos_sin, *kv_cache, meta.slot_mapping, policy=policy)
        elif kv_cache[0].numel():  # an empty cache (a profiling pass) is not written
            ops.reshape_and_cache(k, v, *kv_cache, meta.slot_mapping, policy=policy)
        return self.shard.all_reduce(self.o_proj(self.attn(q, k, v, kv_cache, meta, policy=policy), rows))

    def _qkv(self, qkv: Tensor, policy: OpsPolicy = FASTEST) -> tuple[Tensor, Tensor, Tensor]:
        """q `[T, H, D]`, k and v `[T, KVH, D]` of the projection `[T, (H + 2 KVH) D]`, q and k normed
        where `qk_norm` says (new tensors then; views into `qkv` otherwise)."""
        tokens, d = qkv.shape[0], self.head_dim
        if self.qk_norm == "projection":
            q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
            flat_q, flat_k, flat_v = qkv.split([q_size, kv_size, kv_size], dim=1)
            q = self.q_norm(flat_q.contiguous(), policy=policy)[0].view(tokens, self.num_heads, d)
            k = self.k_norm(flat_k.contiguous(), policy=policy)[0].view(tokens, self.num_kv_heads, d)
            return q, k, flat_v.view(tokens, self.num_kv_heads, d)
        q, k, v = qkv.view(tokens, -1, d).split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        if self.qk_norm == "head":
            q = self.q_norm(q.reshape(-1, d), policy=policy)[0].view(tokens, self.num_heads, d)
            k = self.k_norm(k.reshape(-1, d), policy=policy)[0].view(tokens, self.num_kv_heads, d)
        return q, k, v


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention block then pre-norm SwiGLU block, residual stream carried alongside;
    each block's output scaled by `residual_multiplier` (Granite) before it joins the stream."""

    def __init__(self, spec: ModelSpec, shard: TPShard = SINGLE, layer: int = 0) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(spec, shard, spec.uses_rope(layer), spec.layer_window(layer))
        self.mlp = _mlp(spec, shard, layer)
        self.local_rope = spec.uses_local_rope(layer)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.residual_multiplier = spec.residual_multiplier

    def forward(self, rope: tuple[Tensor, Tensor], hidden: Tensor, residual: Tensor | None,
                kv_cache: tuple[Tensor, Tensor], meta: AttentionMetadata,
                rows: LinearRows = PLAIN_ROWS) -> tuple[Tensor, Tensor | None]:
        hidden, residual = self.input_layernorm(hidden, residual, rows.ops)
        hidden = self._scaled(self.self_attn(rope, hidden, kv_cache, meta, rows))
        hidden, residual = self.post_attention_layernorm(hidden, residual, rows.ops)
        return self._scaled(self.mlp(hidden, rows)), residual

    def _scaled(self, out: Tensor) -> Tensor:
        return out if self.residual_multiplier == 1.0 else out.mul_(self.residual_multiplier)


class PostNormDecoderLayer(nn.Module):
    """OLMo 2's layer: `h + norm(attn(h))` then `h + norm(mlp(h))`, no pre-norms. It returns the
    stream itself (no separate residual), which the backbone's final norm takes as it is."""

    def __init__(self, spec: ModelSpec, shard: TPShard = SINGLE, layer: int = 0) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(spec, shard, spec.uses_rope(layer), spec.layer_window(layer))
        self.mlp = _mlp(spec, shard, layer)
        self.local_rope = spec.uses_local_rope(layer)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(self, rope: tuple[Tensor, Tensor], hidden: Tensor, residual: Tensor | None,
                kv_cache: tuple[Tensor, Tensor], meta: AttentionMetadata,
                rows: LinearRows = PLAIN_ROWS) -> tuple[Tensor, Tensor | None]:
        stream = hidden if residual is None else hidden + residual
        attn = self.self_attn(rope, stream, kv_cache, meta, rows)
        stream = stream + self.post_attention_layernorm(attn, policy=rows.ops)[0]
        return stream + self.post_feedforward_layernorm(self.mlp(stream, rows), policy=rows.ops)[0], None


class SandwichNormDecoderLayer(nn.Module):
    """Gemma 3's layer: `h + post_norm(attn(pre_norm(h)))` then the same around the MLP. Like
    `PostNormDecoderLayer` it returns the stream itself (no separate residual)."""

    def __init__(self, spec: ModelSpec, shard: TPShard = SINGLE, layer: int = 0) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(spec, shard, spec.uses_rope(layer), spec.layer_window(layer))
        self.mlp = _mlp(spec, shard, layer)
        self.local_rope = spec.uses_local_rope(layer)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.pre_feedforward_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(self, rope: tuple[Tensor, Tensor], hidden: Tensor, residual: Tensor | None,
                kv_cache: tuple[Tensor, Tensor], meta: AttentionMetadata,
                rows: LinearRows = PLAIN_ROWS) -> tuple[Tensor, Tensor | None]:
        stream = hidden if residual is None else hidden + residual
        attn = self.self_attn(rope, self.input_layernorm(stream, policy=rows.ops)[0], kv_cache, meta, rows)
        stream = stream + self.post_attention_layernorm(attn, policy=rows.ops)[0]
        mlp = self.mlp(self.pre_feedforward_layernorm(stream, policy=rows.ops)[0], rows)
        return stream + self.post_feedforward_layernorm(mlp, policy=rows.ops)[0], None


class LlamaBackbone(nn.Module):
    """Embedding, decoder layers and final norm (the HF `model.` prefix)."""

    def __init__(self, spec: ModelSpec, shard: TPShard = SINGLE) -> None:
        super().__init__()
        self.embed_tokens = _embedding(spec, shard)
        layer_cls: type[nn.Module] = LlamaDecoderLayer
        if spec.post_norms:
            layer_cls = PostNormDecoderLayer
        elif spec.sandwich_norms:
            layer_cls = SandwichNormDecoderLayer
        self.layers = nn.ModuleList(layer_cls(spec, shard, i) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(spec.rope, spec.head_dim, spec.max_position_embeddings, spec.rotary_dim)
        self.local_rotary_emb = (None if spec.local_rope is None else  # Gemma 3's sliding layers
                                 RotaryEmbedding(spec.local_rope, spec.head_dim, spec.max_position_embeddings,
                                                 spec.rotary_dim))


def _embedding(spec: ModelSpec, shard: TPShard) -> nn.Embedding:
    """The whole embedding for size 1, else this rank's vocab rows (all of them on rank 0 of a tied model)."""
    if shard.size == 1:
        return nn.Embedding(spec.vocab_size, spec.hidden_size)
    lo, hi = shard.vocab_range(spec)
    rows = spec.vocab_size if spec.tie_word_embeddings and shard.owns_lm_head else shard.vocab_per_rank(spec)
    return VocabParallelEmbedding(rows, spec.hidden_size, (lo, hi), shard)


# names of the mutable flags the execution policy replaced (`use_logit_screen` ... `use_fused_decoder`)
_POLICY_FIELDS = frozenset({"use_logit_screen", "exact_prompt_rows", "bf16_linears", "use_fused_decoder",
                            "fused", "fused_checked", "screen"})


class LMHead:
    """A model's lm_head as the sampler sees it (`engine.sample.head.LogitsHead`): fp32 logits of
    hidden rows (`LlamaForCausalLM.compute_logits`) and the greedy screen (`logit_screen`). The
    tokens are chosen in `engine.sample`. A view made per step: the model does not keep it, so
    the two never hold each other."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        self._model = model
        self.vocab_size = model.spec.vocab_size

    def logits(self, hidden: Tensor) -> Tensor:
        return self._model.compute_logits(hidden)

    def greedy_screen(self) -> LogitScreen | QuantLogitScreen | None:
        return self._model.logit_screen()


class LlamaForCausalLM(nn.Module):
    """The paged Llama-family model: `forward` gives final hidden states, `compute_logits` fp32 logits,
    `head` what the sampler asks of the lm_head (the sampler chooses the tokens: `engine.sample.head`).

    With a `TPShard` of size N it is one rank's part (`engine.model.sharding`): rank 0 keeps the full
    lm_head (the others an empty one: they never compute logits). Its execution modes are its
    `policy`, fixed here; what it builds on first use (the fused decoder, the logit screen) it builds
    itself, from the loaded weights."""

    def __init__(self, spec: ModelSpec, shard: TPShard = SINGLE, policy: ExecutionPolicy | None = None) -> None:
        super().__init__()
        shard.check(spec)
        if shard.size > 1 and spec.qk_norm == "projection":
            raise UnsupportedModelError(
                f"{spec.model_type}: tensor parallelism is not supported with q/k RMSNorm over the whole "
                "projection (its mean of squares spans every rank's heads); use tensor_parallel_size 1")
        if shard.size > 1 and spec.fused_checkpoint:
            raise UnsupportedModelError(
                f"{spec.model_type}: tensor parallelism is not supported for checkpoints that store qkv_proj and "
                "gate_up_proj fused (their per-rank slices are not cut); use tensor_parallel_size 1")
        self.spec = spec
        self.shard = shard
        self.model = LlamaBackbone(spec, shard)
        self.lm_head = Linear(spec.hidden_size, spec.vocab_size if shard.owns_lm_head else 0, bias=False)
        if spec.tie_word_embeddings and shard.owns_lm_head:
            self.lm_head.weight = self.model.embed_tokens.weight
        self._policy = ExecutionPolicy() if policy is None else policy
        self._screen: LogitScreen | QuantLogitScreen | None = None  # made by `logit_screen`
        self._fused: FusedDecoder | None = None
        self._fused_checked = False  # `_fused` is made on the first forward, after the weights are loaded

    @property
    def policy(self) -> ExecutionPolicy:
        """The execution modes given to the constructor (frozen; no setter: a model's arithmetic is
        fixed when it is built)."""
        return self._policy

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _POLICY_FIELDS:  # the flags the policy replaced: setting one would change nothing
            raise AttributeError(f"{name} is fixed by the model's ExecutionPolicy (load_model(policy=...))")
        super().__setattr__(name, value)

    @torch.inference_mode()
    def forward(self, input_ids: Tensor, positions: Tensor, kv_caches: list[tuple[Tensor, Tensor]],
                meta: AttentionMetadata) -> Tensor:
        """`input_ids [T]`, `positions [T]` → normed hidden states `[T, hidden]`."""
        hidden = self.model.embed_tokens(input_ids)
        if self.spec.embedding_multiplier != 1.0:
            hidden = hidden * self.spec.embedding_multiplier
        rope = (positions, self.model.rotary_emb.table(positions))  # shared by every layer
        local = self.model.local_rotary_emb
        local_rope = rope if local is None else (positions, local.table(positions))
        fused = self.fused_decoder()
        policy = self.policy
        exact_rows = meta.num_prefill_tokens if policy.exact_prompt_rows else 0  # prompt rows on fp32 activations
        # bf16 linears: every row of a step of many rows on AMX (outside deterministic mode), else the
        # prompt rows at any count (`ops.quant.bf16_all_rows`), which the fused decoder does not split.
        all_rows = ops.quant.bf16_all_rows(policy.ops)
        bf16 = policy.bf16_linears and (ops.quant.bf16_step(hidden.shape[0], meta.num_prefill_tokens) if all_rows
                                        else exact_rows > 0)
        lora = LoRARows.of(meta.lora_slots)  # adapter rows: each linear holding slots adds their products
        fused_lora = None if fused is None or lora is None else fused.lora_lists()
        if (fused is not None and (lora is None or fused_lora is not None) and (all_rows or not bf16)
                and fused.applies(hidden, kv_caches, meta, bf16, policy.ops)):
            last, stream = fused(hidden, rope, kv_caches, meta, exact_rows, bf16, fused_lora)
            return self.model.norm(last, stream, policy.ops)[0]
        rows = LinearRows(exact_rows, meta.exact_ranges if exact_rows else None, bf16, lora, policy.ops)
        residual: Tensor | None = None
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            hidden, residual = layer(local_rope if layer.local_rope else rope, hidden, residual, kv_cache, meta, rows)
        return self.model.norm(hidden, residual, policy.ops)[0]

    def fused_decoder(self) -> FusedDecoder | None:
        """The layers' one-call form (`engine.model.fused_decoder`), made on first use; None where
        it does not apply or the policy turns it off (`ExecutionPolicy.fused_decoder`)."""
        if not self.policy.fused_decoder:
            return None
        if not self._fused_checked:  # the C++ decoder implements Llama's layer, Qwen3's q/k norm and MoE MLPs
            self._fused = (FusedDecoder.for_layers(list(self.model.layers), self.shard.size)
                           if FusedDecoder.serves(self.spec) else None)
            self._fused_checked = True
        return self._fused

    @property
    def head(self) -> LMHead:
        """The lm_head as the sampler asks it (`engine.sample.head`): logits and the greedy screen."""
        return LMHead(self)

    @torch.inference_mode()
    def compute_logits(self, hidden: Tensor) -> Tensor:
        """Logits `[N, vocab]` in fp32 for the selected hidden rows (a quantized lm_head computes in
        bf16 for many rows where the model's linears do: `ExecutionPolicy.bf16_linears`)."""
        bf16 = self.policy.bf16_linears and hidden.shape[0] >= ops.quant.BF16_MIN_ROWS
        logits = self.lm_head(hidden, LinearRows(bf16=bf16, ops=self.policy.ops)).float()
        return logits if self.spec.logits_scaling == 1.0 else logits / self.spec.logits_scaling

    def logit_screen(self) -> LogitScreen | QuantLogitScreen | None:
        """The lm_head's bf16 screen (a quantized lm_head's int8-activation one), made on first use
        (after the checkpoint is loaded), or None where it does not apply (`LogitScreen.usable`,
        `QuantLogitScreen.for_lm_head`) or the policy turns it off (`ExecutionPolicy.logit_screen`)."""
        if self.spec.logits_scaling != 1.0 or not self.policy.logit_screen:  # a screen's argmax is of the
            return None  # unscaled logits, whose rounding after the division can tie where theirs does not
        if isinstance(self.lm_head, QuantLinear):
            if not (isinstance(self._screen, QuantLogitScreen) and self._screen.serves(self.lm_head)):
                self._screen = QuantLogitScreen.for_lm_head(self.lm_head, self.policy.ops)
            return self._screen
        weight = getattr(self.lm_head, "weight", None)
        if weight is None or not LogitScreen.usable(weight, self.policy.ops):
            return None
        if not isinstance(self._screen, LogitScreen) or self._screen.weight.data_ptr() != weight.data_ptr():
            self._screen = LogitScreen(weight, self.policy.ops)
        return self._screen

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, Tensor]], presliced: bool = False) -> None:
        """Copy HF-named tensors in (stacking q/k/v and gate/up); raise if a parameter stays unfilled.
        Under tensor parallelism each tensor is cut to this rank's slice (`TPShard.weight_slice`),
        unless `presliced` (the loader read only that slice of a safetensors file)."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, full in weights:
            if "rotary_emb.inv_freq" in name or (name == "lm_head.weight" and self.spec.tie_word_embeddings):
                continue
            tensor = full if presliced else self._rank_slice(name, full)
            if tensor is None:
                continue
            moe = self._moe_block(name)
            if moe is not None:
                prefix, block = moe  # the module's prefix; the tensor's name past its first four parts
                local = name.split(".", 4)[4]
                loaded.update(prefix + piece for piece in load_moe_tensor(block, local, tensor))
                continue
            target, rows = self._destination(name, params)
            if target is None:
                raise KeyError(f"checkpoint tensor {name!r} has no place in the model")
            dest = params[target] if rows is None else params[target].narrow(0, *rows)
            if isinstance(self.model.embed_tokens, VocabParallelEmbedding) and target == "model.embed_tokens.weight":
                dest.zero_()  # the last rank's padding rows stay zero
                dest = dest.narrow(0, 0, tensor.shape[0])
            if dest.shape != tensor.shape:
                raise ValueError(f"shape mismatch for {name!r}: checkpoint {tuple(tensor.shape)}, "
                                 f"model {tuple(dest.shape)}")
            dest.copy_(tensor)
            if self.spec.norm_offset and target.endswith("norm.weight"):
                dest.add_(self.spec.norm_offset)  # Gemma's (1 + w): the same fp32 sum HF takes per call
            loaded.update(self._filled(target, rows))
        missing = sorted(self._expected_weights() - loaded)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} weights, e.g. {missing[:3]}")
        if self.spec.rotary_dim is not None:
            self._permute_partial_rotary()

    def _filled(self, target: str, rows: tuple[int, int] | None) -> list[str]:
        """The `_expected_weights` entries a copy into `target` (at `rows`) fills: every shard of a
        fused parameter the checkpoint stores whole (Phi-3's qkv_proj, gate_up_proj)."""
        if rows is not None:
            return [f"{target}[{rows[0]}]"]
        fused = next((f for f in ("qkv_proj", "gate_up_proj") if f".{f}." in target), None)
        if fused is None:
            return [target]
        sizes = self._shard_sizes(fused)
        return [f"{target}[{sum(sizes[:i])}]" for i in range(len(sizes))]

    def _permute_partial_rotary(self) -> None:
        """Reorder each q and k head's rows of qkv_proj (and bias) by `partial_rotary_order`, the
        layout the kernels rotate with the partial table (`RotaryEmbedding`)."""
        spec = self.spec
        assert spec.rotary_dim is not None
        d = spec.head_dim
        order = partial_rotary_order(d, spec.rotary_dim)
        for layer in self.model.layers:
            attn: LlamaAttention = layer.self_attn  # type: ignore[assignment]
            index = torch.cat([h * d + order for h in range(attn.num_heads + attn.num_kv_heads)])
            qkv: Tensor | None
            for qkv in (attn.qkv_proj.weight, attn.qkv_proj.bias):
                if qkv is not None:
                    head_rows = qkv.data[: index.numel()]
                    head_rows.copy_(head_rows.index_select(0, index.to(qkv.device)))

    def _rank_slice(self, name: str, tensor: Tensor) -> Tensor | None:
        """`tensor` cut to this rank's slice; None when the rank does not hold it."""
        if self.shard.size == 1:
            return tensor
        return self.shard.narrow(name, tensor, self.spec)

    def _moe_blocks(self) -> dict[str, SparseMoE]:
        """The sparse MLPs by their checkpoint prefix (`model.layers.3.mlp.`)."""
        return {f"model.layers.{i}.mlp.": layer.mlp for i, layer in enumerate(self.model.layers)
                if isinstance(layer.mlp, SparseMoE)}

    def _moe_block(self, name: str) -> tuple[str, SparseMoE] | None:
        """`(module prefix, block)` of the sparse MLP checkpoint tensor `name` belongs to (`model.layers.3.mlp.`
        or `model.layers.3.block_sparse_moe.`); None for any other tensor."""
        parts = name.split(".")
        if self.spec.moe is None or parts[:2] != ["model", "layers"] or len(parts) < 5:
            return None
        prefix = ".".join(parts[:3]) + f".{_MOE_NAMES.get(parts[3], parts[3])}."
        block = self._moe_blocks().get(prefix)
        return None if block is None else (prefix, block)

    def _expected_weights(self) -> set[str]:
        moe = self._moe_blocks()
        expected = {prefix + piece for prefix, block in moe.items() for piece in expected_moe_pieces(block)}
        for name, param in self.named_parameters():  # a tied lm_head is listed once, as the embedding
            if name == "lm_head.weight" and param.shape[0] == 0:
                continue  # a rank other than 0 holds no lm_head
            if any(name.startswith(prefix) for prefix in moe):
                continue  # the MoE blocks' pieces, listed above
            fused = next((f for f in ("qkv_proj", "gate_up_proj") if f".{f}." in name), None)
            if fused is None:
                expected.add(name)
                continue
            sizes = self._shard_sizes(fused)
            expected.update(f"{name}[{sum(sizes[:i])}]" for i in range(len(sizes)))
        return expected

    def _destination(
        self, name: str, params: dict[str, nn.Parameter]
    ) -> tuple[str | None, tuple[int, int] | None]:
        """Parameter name (and row range, for a stacked shard) that checkpoint tensor `name` fills."""
        if name in params:
            return name, None
        for shard, (fused, index) in _STACKED.items():
            if f".{shard}." in name:
                target = name.replace(shard, fused)
                if target not in params:
                    return None, None
                sizes = self._shard_sizes(fused)
                return target, (sum(sizes[:index]), sizes[index])
        return None, None

    def _shard_sizes(self, fused: str) -> list[int]:
        spec, shard = self.spec, self.shard
        if fused == "qkv_proj":
            kv = shard.local_kv_heads(spec) * spec.head_dim
            return [shard.local_heads(spec) * spec.head_dim, kv, kv]
        return [shard.local_intermediate(spec)] * 2
