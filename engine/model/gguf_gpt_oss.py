"""A gpt-oss GGUF's tensors as transformers' GptOssForCausalLM names and lays them out, every one
dequantized to fp32 (MXFP4 experts with the `gguf` package's reference, with a log line).

llama.cpp's converter splits gpt-oss's experts: `experts.gate_up_proj [E, H, 2I]` (gate and up
interleaved column by column) becomes `ffn_gate_exps` and `ffn_up_exps` `[E, I, H]` (or one fused
`ffn_gate_up_exps` `[E, 2I, H]`, gate rows then up rows), `experts.down_proj [E, I, H]` becomes
`ffn_down_exps [E, H, I]`, their biases split the same way; the router is `ffn_gate_inp`, the
sinks `attn_sinks`, the pre-MLP norm `post_attention_norm`; Q/K rows are not permuted.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from common.log import get_logger
from engine.model.gguf_weights import GGUFWeightError, read_tensor

log = get_logger("gguf")
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")
_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
_LAYER = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
          "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "ffn_gate_inp": "mlp.router"}
_EXPERTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_gate_up_exps", "ffn_down_exps")


def iter_gpt_oss_weights(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the gpt-oss GGUF at `path` in fp32 under its transformers name (what
    `GptOssForCausalLM.load_weights` takes); GGUFWeightError for a tensor with no place."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    experts: dict[tuple[int, str, str], torch.Tensor] = {}
    mxfp4 = 0
    for tensor in reader.tensors:
        values = _fp32(tensor)
        mxfp4 += tensor.tensor_type.name == "MXFP4"
        if tensor.name in _GLOBAL:
            yield _GLOBAL[tensor.name], values
            continue
        match = _BLOCK.match(tensor.name)
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
    if mxfp4:
        log.info("gpt-oss GGUF: MXFP4 expert tensors dequantized to fp32 at load (no packed MXFP4 kernel)",
                 file=str(path), tensors=mxfp4)
    for layer in sorted({key[0] for key in experts}):
        yield from _layer_experts(layer, experts)


def _fp32(tensor: Any) -> torch.Tensor:
    """A reader tensor's values in fp32, in numpy's (reversed ggml) shape."""
    if tensor.tensor_type.name == "MXFP4":
        import gguf

        return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(np.array(tensor.data), tensor.tensor_type)))
    stored = read_tensor(tensor)
    if stored.fmt is None:
        return stored.data
    import ops

    shape = [int(s) for s in reversed(tensor.shape.tolist())]
    return ops.quant.dequantize(stored.data, stored.fmt).reshape(shape)


def _layer_experts(layer: int, experts: dict[tuple[int, str, str], torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """One layer's expert tensors in transformers' gpt-oss layout: gate and up interleaved."""
    prefix = f"model.layers.{layer}.mlp.experts."
    for what, suffix in (("weight", ""), ("bias", "_bias")):
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
