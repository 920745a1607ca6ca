"""A gpt-oss GGUF's tensors as transformers' GptOssForCausalLM names and lays them out, in fp32, except
its expert weights where they can run packed: with `pack_experts`, a layer whose gate, up and down are
all in packed formats (MXFP4 in llama.cpp's files) gets `PackedExperts` on those blocks, installed on
the model; its expert biases are yielded for the model to load. Experts that cannot run packed (a model
not in fp32 on the CPU, quantization='dequantize', a format without a kernel) are dequantized, and the
log line says why.

llama.cpp's converter splits gpt-oss's experts: `experts.gate_up_proj [E, H, 2I]` (gate and up
interleaved column by column) becomes `ffn_gate_exps` and `ffn_up_exps` `[E, I, H]` (or one fused
`ffn_gate_up_exps` `[E, 2I, H]`, gate rows then up rows), `experts.down_proj [E, I, H]` becomes
`ffn_down_exps [E, H, I]`, their biases split the same way; the router is `ffn_gate_inp`, the
sinks `attn_sinks`, the pre-MLP norm `post_attention_norm`; Q/K rows are not permuted.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from common.log import get_logger
from engine.model.gguf_weights import GGUFWeightError, Stored, read_tensor
from engine.model.llama import LlamaForCausalLM
from engine.model.moe import SparseMoE
from engine.model.packed_experts import PackedExperts, Shard, interleave_experts

log = get_logger("gguf")
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")
_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
_LAYER = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
          "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "ffn_gate_inp": "mlp.router"}
_EXPERTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_gate_up_exps", "ffn_down_exps")


def iter_gpt_oss_weights(path: Path, model: LlamaForCausalLM | None = None,
                         pack_experts: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the gpt-oss GGUF at `path` under its transformers name (what
    `GptOssForCausalLM.load_weights` takes), in fp32; with `pack_experts` (and `model`, the
    GptOssForCausalLM being loaded) the expert weights that can run packed go into `PackedExperts` on
    `model` instead of being yielded. GGUFWeightError for a tensor with no place."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    experts: dict[tuple[int, str, str], torch.Tensor] = {}
    stored: dict[tuple[int, str], _Expert] = {}  # expert weights as the file stores them
    for tensor in reader.tensors:
        match = _BLOCK.match(tensor.name)
        if match is not None and match[2] in _EXPERTS and match[3] == "weight":
            shape = tuple(int(s) for s in reversed(tensor.shape.tolist()))
            if len(shape) != 3:
                raise GGUFWeightError(f"gpt-oss GGUF expert tensor {tensor.name!r} has shape {list(shape)}, "
                                      "not [experts, rows, K]")
            stored[int(match[1]), match[2]] = _Expert(read_tensor(tensor), shape)
            continue
        values = _fp32(tensor)
        if tensor.name in _GLOBAL:
            yield _GLOBAL[tensor.name], values
            continue
        if match is None:
            raise GGUFWeightError(f"GGUF tensor {tensor.name!r} has no place in a gpt-oss model")
        layer, kind, what = int(match[1]), match[2], match[3]
        if kind == "attn_sinks":
            yield f"model.layers.{layer}.self_attn.sinks", values
        elif kind in _LAYER:
            yield f"model.layers.{layer}.{_LAYER[kind]}.{what}", values
        elif kind in _EXPERTS:
            experts[layer, kind, what] = values
        else:
            raise GGUFWeightError(f"GGUF tensor {tensor.name!r} has no place in a gpt-oss model")
    layers = sorted({key[0] for key in experts} | {key[0] for key in stored})
    blocks = _sparse_blocks(model, layers)
    why = _cannot_pack(model, pack_experts, stored)
    formats = sorted({e.stored.source for e in stored.values()})
    if why is None:
        log.info("gpt-oss GGUF: expert weights run packed in their blocks (PackedExperts)", file=str(path),
                 formats=formats, layers=len(layers))
    elif any(f not in _FLOATS for f in formats):
        log.info(f"gpt-oss GGUF: expert weights dequantized to fp32 at load: {why}", file=str(path), formats=formats)
    for layer in layers:
        parts = {kind: e for (at, kind), e in stored.items() if at == layer}
        if why is None:
            blocks[layer].experts = _packed_experts(layer, blocks[layer], parts)  # type: ignore[assignment]
        else:
            experts.update(((layer, kind, "weight"), e.values()) for kind, e in parts.items())
        yield from _layer_experts(layer, experts, weights=why is not None)


_FLOATS = ("F32", "F16", "BF16")


def _sparse_blocks(model: LlamaForCausalLM | None, layers: list[int]) -> dict[int, SparseMoE]:
    """The model's sparse MoE block of each layer that has expert tensors (none without a model)."""
    if model is None:
        return {}
    blocks = {i: layer.mlp for i, layer in enumerate(model.model.layers) if isinstance(layer.mlp, SparseMoE)}
    if set(layers) - set(blocks):
        raise GGUFWeightError(f"gpt-oss GGUF has expert tensors for layers {sorted(set(layers) - set(blocks))} "
                              "whose model layer has no MoE block")
    return blocks


def _cannot_pack(model: LlamaForCausalLM | None, pack_experts: bool,
                 stored: dict[tuple[int, str], _Expert]) -> str | None:
    """Why the expert weights cannot run packed (None: they can)."""
    if not pack_experts or model is None:
        return "quantization='dequantize'"
    param = next(model.parameters())
    if param.dtype != torch.float32 or param.device.type != "cpu":
        return (f"the packed kernels take fp32 activations on the CPU; the model is {param.dtype} on "
                f"{param.device.type}")
    unpacked = sorted({e.stored.source for e in stored.values() if e.stored.fmt is None})
    if unpacked:
        return f"{', '.join(unpacked)} expert weights have no packed kernel"
    return None


@dataclass(frozen=True, slots=True)
class _Expert:
    """A stacked expert weight as the file stores it, and its shape `[experts, rows, K]`."""

    stored: Stored
    shape: tuple[int, ...]

    def rows(self) -> Shard:
        """The packed `[experts, rows, row_bytes]` (a packed format)."""
        fmt = self.stored.fmt
        assert fmt is not None
        experts, rows, k = self.shape
        return fmt, self.stored.data.reshape(experts, rows, fmt.row_bytes(k))

    def values(self) -> torch.Tensor:
        """fp32 `[experts, rows, K]`."""
        if self.stored.fmt is None:
            return self.stored.data.reshape(self.shape)
        import ops

        fmt, rows = self.rows()
        return ops.quant.dequantize(rows.reshape(-1, rows.shape[-1]), fmt, self.shape[2]).reshape(self.shape)


def _packed_experts(layer: int, block: SparseMoE, parts: dict[str, _Expert]) -> PackedExperts:
    """Layer `layer`'s `PackedExperts` on its packed expert weights (gate rows then up rows, and down)."""
    if "ffn_gate_up_exps" in parts:
        gate_up = [parts["ffn_gate_up_exps"].rows()]
    elif "ffn_gate_exps" in parts and "ffn_up_exps" in parts:
        gate, up = parts["ffn_gate_exps"].rows(), parts["ffn_up_exps"].rows()
        gate_up = [(gate[0], torch.cat([gate[1], up[1]], dim=1))] if gate[0] == up[0] else [gate, up]
    else:
        raise GGUFWeightError(f"gpt-oss GGUF layer {layer} lacks expert weights (gate and up)")
    if "ffn_down_exps" not in parts:
        raise GGUFWeightError(f"gpt-oss GGUF layer {layer} lacks expert weights (down)")
    hidden = parts["ffn_down_exps"].shape[1]
    try:
        return PackedExperts(block.spec, hidden, [interleave_experts(*s) for s in gate_up],
                             interleave_experts(*parts["ffn_down_exps"].rows()))
    except ValueError as error:
        raise GGUFWeightError(f"gpt-oss GGUF layer {layer}: {error}") from None


def _fp32(tensor: Any) -> torch.Tensor:
    """A reader tensor's values in fp32, in numpy's (reversed ggml) shape."""
    stored = read_tensor(tensor)
    if stored.fmt is None:
        return stored.data
    import ops

    shape = [int(s) for s in reversed(tensor.shape.tolist())]
    return ops.quant.dequantize(stored.data, stored.fmt).reshape(shape)


def _layer_experts(layer: int, experts: dict[tuple[int, str, str], torch.Tensor],
                   weights: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """One layer's expert tensors in transformers' gpt-oss layout (gate and up interleaved); its biases
    only where not `weights` (the weights run packed)."""
    prefix = f"model.layers.{layer}.mlp.experts."
    for what, suffix in (("weight", ""), ("bias", "_bias")):
        if what == "weight" and not weights:
            continue
        fused = experts.get((layer, "ffn_gate_up_exps", what))
        gate: torch.Tensor | None
        up: torch.Tensor | None
        if fused is not None:
            gate, up = fused.chunk(2, dim=1 if what == "weight" else -1)
        else:
            gate, up = experts.get((layer, "ffn_gate_exps", what)), experts.get((layer, "ffn_up_exps", what))
        down = experts.get((layer, "ffn_down_exps", what))
        if gate is None or up is None or down is None:
            raise GGUFWeightError(f"gpt-oss GGUF layer {layer} lacks expert {what}s (gate, up and down)")
        if what == "weight":  # [E, I, H] each -> [E, H, 2I]; down [E, H, I] -> [E, I, H]
            gate_up = torch.stack((gate, up), dim=2).reshape(gate.shape[0], -1, gate.shape[2]).transpose(1, 2)
            yield prefix + "gate_up_proj", gate_up.contiguous()
            yield prefix + "down_proj", down.transpose(1, 2).contiguous()
        else:  # [E, I] each -> [E, 2I]; down [E, H]
            yield prefix + "gate_up_proj" + suffix, torch.stack((gate, up), dim=2).reshape(gate.shape[0], -1)
            yield prefix + "down_proj" + suffix, down
