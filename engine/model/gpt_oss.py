"""gpt-oss (transformers' `gpt_oss`, GptOssForCausalLM) on the paged KV cache: the Llama-family
decoder with q/k/v/o biases, yarn rotary, alternating sliding / full layers (`layer_types`), the
sparse MoE block of `engine.model.moe` (router with bias, top-k then softmax over the chosen
logits, clamped SwiGLU experts with biases), and attention sinks: a learned logit per head,
`self_attn.sinks`, that joins each query's softmax denominator and carries no value.

MXFP4 checkpoints (the experts as `*_blocks` / `*_scales`, transformers' integrations/mxfp4.py) are
dequantized at load (`dequantize_mxfp4`, with a log line); nothing of them stays packed.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import Tensor, nn

import ops
from common.log import get_logger
from engine.model.attention import AttentionMetadata
from engine.model.execution_policy import PLAIN_ROWS, ExecutionPolicy, LinearRows
from engine.model.llama import LlamaAttention, LlamaForCausalLM
from engine.model.sharding import SINGLE, TPShard
from engine.model.spec import ModelSpec, UnsupportedModelError

log = get_logger("gpt_oss")

# transformers' integrations/mxfp4.py: the 16 values of an FP4 (e2m1) nibble
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_SUFFIXES = ("_blocks", "_scales")


class GptOssAttention(LlamaAttention):
    """`LlamaAttention` with the per-head `sinks` (fp32 into the kernels whatever the model dtype)."""

    def __init__(self, spec: ModelSpec, shard: TPShard = SINGLE, use_rope: bool = True, window: int = 0) -> None:
        super().__init__(spec, shard, use_rope, window)
        self.sinks = nn.Parameter(torch.empty(self.num_heads))

    def forward(self, rope: tuple[Tensor, Tensor], hidden: Tensor, kv_cache: tuple[Tensor, Tensor],
                meta: AttentionMetadata, rows: LinearRows = PLAIN_ROWS) -> Tensor:
        policy = rows.ops
        q, k, v = self._qkv(self.qkv_proj(hidden, rows), policy)
        positions, cos_sin = rope
        ops.rotary_embedding_and_cache(positions, q, k, v, cos_sin, *kv_cache, meta.slot_mapping, policy=policy)
        sinks = (self.sinks if self.sinks.dtype == torch.float32 else self.sinks.float()).contiguous()
        return self.shard.all_reduce(self.o_proj(self.attn(q, k, v, kv_cache, meta, sinks, policy=policy), rows))


class GptOssForCausalLM(LlamaForCausalLM):
    """The paged gpt-oss model: `LlamaForCausalLM` whose layers attend with sinks (`GptOssAttention`).
    Under tensor parallelism each rank holds its query heads' sinks and its share of every expert
    (`engine.model.sharding`)."""

    def __init__(self, spec: ModelSpec, shard: TPShard = SINGLE, policy: ExecutionPolicy | None = None) -> None:
        if spec.model_type != "gpt_oss" or not spec.attention_sinks or spec.moe is None:
            raise UnsupportedModelError(f"GptOssForCausalLM serves gpt_oss specs, got {spec.model_type!r}")
        super().__init__(spec, shard, policy)
        for i, layer in enumerate(self.model.layers):
            layer.self_attn = GptOssAttention(spec, shard, spec.uses_rope(i), spec.layer_window(i))

    def load_weights(self, weights: Iterable[tuple[str, Tensor]], presliced: bool = False) -> None:
        super().load_weights(dequantize_mxfp4(weights), presliced)


def dequantize_mxfp4(weights: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
    """The checkpoint's tensors with each MXFP4 pair `X_blocks [E, R, G, 16]` (uint8, two FP4 values a
    byte, low nibble first) and `X_scales [E, R, G]` (uint8 exponents, bias 127) replaced by `X`, the
    fp32 `[E, G * 32, R]` transformers' gpt-oss holds (its `convert_moe_packed_tensors`); every other
    tensor passes as it is. Logs once when it dequantizes anything."""
    pending: dict[str, dict[str, Tensor]] = {}
    logged = False
    for name, tensor in weights:
        suffix = next((s for s in MXFP4_SUFFIXES if name.endswith(s)), None)
        if suffix is None:
            yield name, tensor
            continue
        base = name.removesuffix(suffix)
        parts = pending.setdefault(base, {})
        parts[suffix] = tensor
        if len(parts) < 2:
            continue
        del pending[base]
        if not logged:
            log.info("MXFP4 checkpoint: the experts' blocks and scales are dequantized to the model dtype at load "
                     "(no packed MXFP4 kernel)", first=base)
            logged = True
        yield base, mxfp4_to_float(parts["_blocks"], parts["_scales"])
    if pending:
        base, parts = next(iter(pending.items()))
        raise ValueError(f"MXFP4 tensor {base!r} has {next(iter(parts))} without its "
                         f"{'_scales' if '_blocks' in parts else '_blocks'}")


def mxfp4_to_float(blocks: Tensor, scales: Tensor) -> Tensor:
    """`blocks [E, R, G, B]` uint8 and `scales [E, R, G]` uint8 -> fp32 `[E, G * 2B, R]`: value
    `FP4_VALUES[nibble] * 2 ** (scale - 127)`, the two nibbles of a byte in low, high order."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.dim() != 4 \
            or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} {blocks.dtype} and scales {tuple(scales.shape)} "
                         f"{scales.dtype} do not pair (uint8 [E, R, G, B] and [E, R, G])")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    e, r, g, b = blocks.shape
    values = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1).view(e, r, g, 2 * b)
    values = torch.ldexp(values, (scales.to(torch.int32) - 127)[..., None])
    return values.reshape(e, r, g * 2 * b).transpose(1, 2).contiguous()
