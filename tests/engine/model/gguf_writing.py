"""What the GGUF-writing tests share: the decoder shape keys every llama.cpp architecture carries,
and the check that a packed model with fp32 activations gives transformers' logits."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.model.packed_experts import PackedExperts
from engine.model.quant_linear import QuantLinear
from tests.engine.model.test_sliding_window import prompt_ids
from tests.fixtures.models import PagedHarness, Seq


def add_decoder_shape(writer: Any, config: Any) -> None:
    """`{arch}.context_length`, `.embedding_length`, `.block_count`, `.feed_forward_length` and the
    attention head counts of a transformers `config` (a `gguf.GGUFWriter` names the arch)."""
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)


def assert_fp32_activation_logits_match(ours: nn.Module, hf: nn.Module) -> None:
    """With fp32 activations, the packed model's logits over a prefill and 14 decode steps are
    transformers' on the same (dequantized) weights, within 1e-4."""
    for module in ours.modules():
        if isinstance(module, (QuantLinear, PackedExperts)):
            module.int8_activations = False
    tokens = prompt_ids(24, 5)
    with torch.no_grad():
        reference = hf(torch.tensor([tokens])).logits[0]
    harness, seq = PagedHarness(ours, seed=2), Seq(tokens)
    logits = [harness.step([(seq, 10)], [])] + [harness.step([], [seq]) for _ in range(14)]
    torch.testing.assert_close(torch.cat(logits), reference, rtol=1e-4, atol=1e-4)


def llama3_rope_freqs(rope: dict[str, Any], head_dim: int) -> Any:
    """The `rope_freqs.weight` llama.cpp's converter writes for a `llama3` rope (its
    LlamaModel.generate_extra_tensors): per frequency of the fp32 default rotation, 1 where the
    wavelength is under original / high_freq_factor, `factor` past original / low_freq_factor, and
    1 / ((1 - s) / factor + s) between, s the smooth ramp; fp32, one entry per rotated pair."""
    import math

    import numpy as np

    theta, factor = float(rope["rope_theta"]), float(rope["factor"])
    low, high = float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
    original = float(rope["original_max_position_embeddings"])
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    out = []
    for freq in freqs.tolist():
        wavelength = 2 * math.pi / freq
        if wavelength < original / high:
            out.append(1.0)
        elif wavelength > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            out.append(1.0 / ((1.0 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _llama_cpp_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter's Q/K row order (RoPE pairs interleaved within each head)."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


def write_llama_gguf(model: nn.Module, path: Any, fmt: str, metadata: Any = None, rope_freqs: Any = None,
                     split_experts: bool = False) -> dict[str, torch.Tensor]:
    """A transformers Llama or Mixtral `model` as llama.cpp's converter writes it (arch `llama`): Q/K rows
    permuted; Mixtral's router `ffn_gate_inp` and experts stacked `ffn_{gate,up,down}_exps` [E, rows, K]
    (`split_experts`: the older `ffn_{gate,up,down}.E` tensor per expert) with `llama.expert_count` /
    `expert_used_count`; 2-D and 3-D weights in `fmt`, norms F32; `rope_freqs` (fp32 array) as
    `rope_freqs.weight`; `metadata(writer)` adds keys. Returns the HF state dict holding the file's values."""
    import gguf
    import numpy as np

    from tests.engine.model.test_gguf_moe_packed import _encode

    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    writer = gguf.GGUFWriter(str(path), "llama")
    add_decoder_shape(writer, config)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_rope_dimension_count(config.hidden_size // heads)
    writer.add_vocab_size(config.vocab_size)
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    experts = getattr(config, "num_local_experts", 0)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
    if metadata is not None:
        metadata(writer)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    state: dict[str, torch.Tensor] = {}

    def add(name: str, weight: torch.Tensor, stored_weight: torch.Tensor | None = None) -> torch.Tensor:
        kind = "F32" if weight.dim() == 1 or ".ffn_gate_inp." in name else fmt  # llama.cpp keeps the router F32
        data = (weight if stored_weight is None else stored_weight).detach().float().contiguous().numpy()
        stored, _ = _encode(np.ascontiguousarray(data), kind)
        writer.add_tensor(name, stored, raw_dtype=gguf.GGMLQuantizationType[kind])
        return torch.from_numpy(np.ascontiguousarray(_encode(weight.detach().float().contiguous().numpy(), kind)[1]))

    for hf_name, value in model.state_dict().items():
        base, _, suffix = hf_name.rpartition(".")
        if base.endswith("mlp.experts"):
            layer = hf_name.split(".")[2]
            parts = dict(zip(("gate", "up"), value.chunk(2, dim=1), strict=True)) if suffix == "gate_up_proj" else {
                "down": value}
            values = {}
            for part, weight in parts.items():
                if split_experts:
                    values[part] = torch.stack([add(f"blk.{layer}.ffn_{part}.{e}.weight", w)
                                                for e, w in enumerate(weight)])
                else:
                    values[part] = add(f"blk.{layer}.ffn_{part}_exps.weight", weight)
            state[hf_name] = torch.cat([values["gate"], values["up"]], dim=1) if "gate" in values else values["down"]
            continue
        name = f"blk.{hf_name.split('.')[2]}.ffn_gate_inp" if base.endswith("mlp.gate") else names.get_name(base)
        assert name is not None, hf_name
        permuted = None
        if name.endswith(("attn_q", "attn_k")):
            permuted = _llama_cpp_rows(value, heads if name.endswith("attn_q") else kv_heads)
        state[hf_name] = add(f"{name}.{suffix}", value, permuted)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs, raw_dtype=gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return state
