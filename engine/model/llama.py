"""Llama-family decoder (Llama, Mistral, Qwen2, SmolLM) on the paged KV cache.

Parameter names follow the HF checkpoints except for the fused `qkv_proj` and `gate_up_proj`,
whose shards are stacked at load time by `load_weights`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch
from torch import Tensor, nn

import ops
from engine.model.attention import AttentionMetadata, PagedAttention
from engine.model.layers import Linear, RMSNorm, SwiGLU
from engine.model.logit_screen import LogitScreen
from engine.model.quant_linear import QuantLinear
from engine.model.quant_screen import QuantLogitScreen
from engine.model.rope import RotaryEmbedding
from engine.model.spec import ModelSpec

LOGITS_GROUP_BYTES = 24 << 20  # logits of one `pick_tokens` group: under a 32 MiB L3 with room to spare


class TokenPicker(Protocol):
    """How `pick_tokens` turns rows of logits into tokens (`engine.sample.sampler.TokenPlan`).

    `logit_rows` (sorted) are rows of the step that come back as logits instead (the runner's
    concern: `ModelRunner.execute`); the picker's own rows are the step's other rows, in order."""

    random_rows: list[int]  # sorted rows drawn from their logits; every other row is greedy (argmax)
    logit_rows: list[int]

    def __call__(self, logits: Tensor, first_row: int) -> Tensor:
        """The int64 tokens of the rows from `first_row` on, given their logits."""
        ...

    def only_random(self) -> TokenPicker:
        """The picker of the random rows alone, renumbered from 0."""
        ...

# HF shard name -> (fused parameter, shard index)
_STACKED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


class LlamaAttention(nn.Module):
    """Fused QKV projection, RoPE fused with the K/V cache write, paged attention, output projection;
    GQA when kv heads < heads."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.head_dim, self.num_heads, self.num_kv_heads = spec.head_dim, spec.num_heads, spec.num_kv_heads
        q_size, kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        self.qkv_proj = Linear(spec.hidden_size, q_size + 2 * kv_size, bias=spec.qkv_bias)
        self.o_proj = Linear(q_size, spec.hidden_size, bias=spec.o_bias)
        self.attn = PagedAttention(spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.head_dim**-0.5)

    def forward(self, rope: tuple[Tensor, Tensor], hidden: Tensor, kv_cache: tuple[Tensor, Tensor],
                meta: AttentionMetadata) -> Tensor:
        """`rope` is `(positions [T], cos/sin table)`; q and k are rotated in place inside the qkv
        output, and k, v land in the cache in the same pass."""
        qkv = self.qkv_proj(hidden).view(hidden.shape[0], -1, self.head_dim)  # [T, H + 2 KVH, D]
        q, k, v = qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        positions, cos_sin = rope
        ops.rotary_embedding_and_cache(positions, q, k, v, cos_sin, *kv_cache, meta.slot_mapping)
        return self.o_proj(self.attn(q, k, v, kv_cache, meta))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention block then pre-norm SwiGLU block, residual stream carried alongside."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(spec)
        self.mlp = SwiGLU(spec.hidden_size, spec.intermediate_size, spec.mlp_bias)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(self, rope: tuple[Tensor, Tensor], hidden: Tensor, residual: Tensor | None,
                kv_cache: tuple[Tensor, Tensor], meta: AttentionMetadata) -> tuple[Tensor, Tensor]:
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(rope, hidden, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaBackbone(nn.Module):
    """Embedding, decoder layers and final norm (the HF `model.` prefix)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(spec) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(spec.rope, spec.head_dim, spec.max_position_embeddings)


class LlamaForCausalLM(nn.Module):
    """The paged Llama-family model: `forward` gives final hidden states, `compute_logits` fp32 logits."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.model = LlamaBackbone(spec)
        self.lm_head = Linear(spec.hidden_size, spec.vocab_size, bias=False)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.use_logit_screen = True  # greedy rows through `LogitScreen` where it applies
        self.screen: LogitScreen | QuantLogitScreen | None = None

    @torch.inference_mode()
    def forward(self, input_ids: Tensor, positions: Tensor, kv_caches: list[tuple[Tensor, Tensor]],
                meta: AttentionMetadata) -> Tensor:
        """`input_ids [T]`, `positions [T]` → normed hidden states `[T, hidden]`."""
        hidden = self.model.embed_tokens(input_ids)
        rope = (positions, self.model.rotary_emb.table(positions))  # shared by every layer
        residual: Tensor | None = None
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            hidden, residual = layer(rope, hidden, residual, kv_cache, meta)
        return self.model.norm(hidden, residual)[0]

    @torch.inference_mode()
    def compute_logits(self, hidden: Tensor) -> Tensor:
        """Logits `[N, vocab]` in fp32 for the selected hidden rows."""
        return self.lm_head(hidden).float()

    @torch.inference_mode()
    def pick_tokens(self, hidden: Tensor, pick: TokenPicker) -> Tensor:
        """One int64 token per row, as `pick` would take it from the rows' fp32 logits, without
        keeping the logits matrix. Greedy rows go through the bf16 logit screen where the CPU has
        one (`LogitScreen`: the same argmax, a third of the GEMM); the other rows through
        `_pick_in_groups`."""
        screen = self.logit_screen()
        if screen is None or len(pick.random_rows) == hidden.shape[0]:
            return self._pick_in_groups(hidden, pick)
        if not pick.random_rows:
            return screen.argmax(hidden)
        random = torch.tensor(pick.random_rows, dtype=torch.long)
        greedy = torch.ones(hidden.shape[0], dtype=torch.bool)
        greedy[random] = False
        greedy_rows = greedy.nonzero().squeeze(1)
        tokens = torch.empty(hidden.shape[0], dtype=torch.long)
        tokens[greedy_rows] = screen.argmax(hidden.index_select(0, greedy_rows))
        tokens[random] = self._pick_in_groups(hidden.index_select(0, random), pick.only_random())
        return tokens

    def logit_screen(self) -> LogitScreen | QuantLogitScreen | None:
        """The lm_head's bf16 screen (a quantized lm_head's int8-activation one), made on first use
        (after the checkpoint is loaded), or None where it does not apply (`LogitScreen.usable`,
        `QuantLogitScreen.for_lm_head`) or `use_logit_screen` is off."""
        if self.use_logit_screen and isinstance(self.lm_head, QuantLinear):
            if not (isinstance(self.screen, QuantLogitScreen) and self.screen.serves(self.lm_head)):
                self.screen = QuantLogitScreen.for_lm_head(self.lm_head)
            return self.screen
        weight = getattr(self.lm_head, "weight", None)
        if not self.use_logit_screen or weight is None or not LogitScreen.usable(weight):
            return None
        if not isinstance(self.screen, LogitScreen) or self.screen.weight.data_ptr() != weight.data_ptr():
            self.screen = LogitScreen(weight)
        return self.screen

    def _pick_in_groups(self, hidden: Tensor, pick: TokenPicker) -> Tensor:
        """The lm_head in groups of rows whose logits fit in a CPU's last-level cache
        (`LOGITS_GROUP_BYTES`), each turned into tokens by `pick` while still cached: at batch
        256 of a 49k vocabulary a greedy step is 15% faster than one GEMM writing 50 MB and a
        second pass reading it back. The logits are those of `compute_logits(hidden)` (the GEMM's
        rows do not depend on how many rows it is given; the tests compare the two)."""
        group = hidden.shape[0] if hidden.is_cuda else max(1, LOGITS_GROUP_BYTES // (4 * self.spec.vocab_size))
        if hidden.shape[0] <= group:
            return pick(self.compute_logits(hidden), 0)
        return torch.cat([pick(self.compute_logits(part), i * group) for i, part in enumerate(hidden.split(group))])

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """Copy HF-named tensors in (stacking q/k/v and gate/up); raise if a parameter stays unfilled."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or (name == "lm_head.weight" and self.spec.tie_word_embeddings):
                continue
            target, rows = self._destination(name, params)
            if target is None:
                raise KeyError(f"checkpoint tensor {name!r} has no place in the model")
            dest = params[target] if rows is None else params[target].narrow(0, *rows)
            if dest.shape != tensor.shape:
                raise ValueError(f"shape mismatch for {name!r}: checkpoint {tuple(tensor.shape)}, "
                                 f"model {tuple(dest.shape)}")
            dest.copy_(tensor)
            loaded.add(target if rows is None else f"{target}[{rows[0]}]")
        missing = sorted(self._expected_weights() - loaded)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} weights, e.g. {missing[:3]}")

    def _expected_weights(self) -> set[str]:
        expected: set[str] = set()
        for name, _ in self.named_parameters():  # a tied lm_head is listed once, as the embedding
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
        spec = self.spec
        if fused == "qkv_proj":
            kv = spec.num_kv_heads * spec.head_dim
            return [spec.num_heads * spec.head_dim, kv, kv]
        return [spec.intermediate_size] * 2
