"""GGUF files of the families past Llama's (Qwen3, Gemma 3), written here from a seeded random
transformers checkpoint of each as llama.cpp's converter lays them out (its tensor names, its
metadata keys, Gemma's norms stored as 1 + w, stacked experts), in F32 and in Q8_0: the weights
pagedserve loads equal transformers' load of the same file; engine greedy equals transformers'
generate on it (F32); packed Q8_0 files (the MoE files' experts too: `PackedExperts`) run int8
activations, so there the paged model's logits with fp32 activations equal transformers'."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from common.sampling_params import SamplingParams
from engine.llm import LLM
from engine.model import load_model
from engine.model.loader import ModelLoadError
from engine.model.packed_experts import PackedExperts
from engine.model.quant_linear import QuantLinear
from tests.engine.helpers import assert_no_leaks, generated
from tests.engine.model.gguf_writing import add_decoder_shape, assert_fp32_activation_logits_match
from tests.engine.model.test_gguf_formats import _weight
from tests.engine.model.test_sliding_window import make_family_dir, prompt_ids

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType

# name -> (HF model type, GGUF architecture, config overrides). Qwen3's GGUF config takes head_dim
# from Qwen3Config's default (transformers maps no key_length for qwen3), so the checkpoint uses it.
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "qwen3": ("qwen3", "qwen3", {"head_dim": 128}),
    # transformers' GGUF config of gemma3 keeps Gemma3TextConfig's layer pattern and
    # query_pre_attn_scalar; the checkpoint is made with the same, 6 layers: 5 sliding, 1 full
    "gemma3": ("gemma3_text", "gemma3", {"head_dim": 32, "num_hidden_layers": 6, "sliding_window": 512,
                                         "tie_word_embeddings": True}),
    "phi3": ("phi3", "phi3", {}),  # attn_qkv and ffn_up (gate then up rows) fused, as in the checkpoint
    # the GGUF configs keep the expert sizes' defaults (transformers maps no expert_feed_forward_length)
    "qwen3_moe": ("qwen3_moe", "qwen3moe", {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2}),
    "qwen2_moe": ("qwen2_moe", "qwen2moe", {"num_experts": 4, "num_experts_per_tok": 2}),
}
MOE = ("qwen3moe", "qwen2moe")
FORMATS = ("F32", "Q8_0")


def write_family_gguf(model_dir: Path, arch: str, fmt: str, rope_dims: int | None = None,
                      rope_scaling: float | None = None) -> Path:
    """`model_dir`'s checkpoint as `<arch>-<fmt>.gguf` beside it: llama.cpp's tensor names for
    `arch`, 2-D weights in `fmt` (norms F32), Gemma's norms as 1 + w; no output.weight when tied;
    `rope_dims` (default: head_dim) as rope.dimension_count, `rope_scaling` a linear rope.scaling factor."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(model_dir))
    hf = load_file(str(model_dir / "model.safetensors"))
    arch_id = next(key for key, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    names = gguf.get_tensor_name_map(arch_id, config.num_hidden_layers)
    path = model_dir / f"{arch}-{fmt}.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    add_decoder_shape(writer, config)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(float(config.rope_parameters.get("rope_theta")
                                    or config.rope_parameters["full_attention"]["rope_theta"]))
    writer.add_vocab_size(config.vocab_size)
    writer.add_rope_dimension_count(rope_dims or head_dim)
    if rope_scaling is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope_scaling)
    if arch == "gemma3":
        writer.add_sliding_window(config.sliding_window)
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    writer.add_pad_token_id(config.pad_token_id)  # Phi3Config's default (32000) is outside this vocabulary
    if arch in MOE:
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
    for hf_name, weight in _stack_experts(hf, config).items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        base, _, suffix = hf_name.rpartition(".")
        name = base if base.startswith("blk.") else names.get_name(base)
        assert name is not None, hf_name
        data = weight.float().numpy()
        if base.endswith("shared_expert_gate"):
            data = data.reshape(-1)  # llama.cpp stores the shared expert's gate as one row of hidden
        if arch == "gemma3" and "norm" in base:
            data = data + 1.0  # llama.cpp's Gemma converter stores the (1 + w) the norms scale by
        if fmt == "F32" or data.ndim == 1:
            writer.add_tensor(f"{name}.{suffix}", data, raw_dtype=T.F32)
        else:
            writer.add_tensor(f"{name}.{suffix}", gguf.quants.quantize(data, T[fmt]), raw_dtype=T[fmt])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _stack_experts(hf: dict[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
    """Per-expert checkpoint tensors stacked as llama.cpp's converter writes them: one
    `ffn_{gate,up,down}_exps` tensor [experts, rows, columns] per layer (the rest as they are)."""
    out = {name: t for name, t in hf.items() if ".mlp.experts." not in name}
    if not getattr(config, "num_experts", None):
        return out
    for i in range(config.num_hidden_layers):
        for part, gguf_part in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down")):
            experts = [hf.get(f"model.layers.{i}.mlp.experts.{e}.{part}.weight") for e in range(config.num_experts)]
            if experts[0] is not None:
                out[f"blk.{i}.ffn_{gguf_part}_exps.weight"] = torch.stack(experts)  # type: ignore[arg-type]
    return out


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    model_type, arch, overrides = FAMILIES[request.param]
    return arch, make_family_dir(tmp_path_factory.mktemp(request.param), model_type, seed=3, **overrides)


def _transformers_model(file: Path) -> nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(file.parent), gguf_file=file.name, dtype=torch.float32).eval()


def _effective_norm(name: str, weight: torch.Tensor, offset: float) -> torch.Tensor:
    """What a transformers norm scales by: Gemma's offset + w in fp32, others w."""
    return offset + weight.float() if offset and name.endswith("norm.weight") else weight


def _assert_weights_equal(ours: nn.Module, hf: nn.Module) -> None:
    state, offset = hf.state_dict(), ours.spec.norm_offset
    params = dict(ours.named_parameters())
    assert torch.equal(_weight(ours.model.embed_tokens), state["model.embed_tokens.weight"])
    head = state["model.embed_tokens.weight"] if ours.spec.tie_word_embeddings else state["lm_head.weight"]
    assert torch.equal(_weight(ours.lm_head), head)
    checked = 0
    for name, value in state.items():
        if name.endswith("norm.weight"):
            assert torch.equal(params[name], _effective_norm(name, value, offset)), name
            checked += 1
    per_layer = (4 if ours.spec.sandwich_norms else 2) + (2 if ours.spec.qk_norm == "head" else 0)
    assert checked == 1 + ours.spec.num_layers * per_layer
    for i, layer in enumerate(ours.model.layers):
        prefix = f"model.layers.{i}."
        stacked = {"self_attn.qkv_proj": ("q", "k", "v"), "mlp.gate_up_proj": ("gate", "up"),
                   "mlp.shared_expert.gate_up_proj": ("gate", "up")}
        plain = ["self_attn.o_proj", "mlp.down_proj", "mlp.shared_expert.down_proj", "mlp.shared_expert_gate",
                 "mlp.gate"]
        for path, parts in stacked.items():
            if f"{prefix}{path}.weight" in state:  # Phi-3: fused in transformers' model too
                assert torch.equal(_weight(layer.get_submodule(path)), state[f"{prefix}{path}.weight"]), (i, path)
                continue
            if not _has(layer, path):
                continue
            group = path.rpartition(".")[0]
            expected = torch.cat([state[f"{prefix}{group}.{p}_proj.weight"] for p in parts])
            assert torch.equal(_weight(layer.get_submodule(path)), expected), (i, path)
        for path in [p for p in plain if _has(layer, p)]:
            assert torch.equal(_weight(layer.get_submodule(path)), state[f"{prefix}{path}.weight"]), (i, path)
        if ours.spec.is_sparse(i):
            experts = layer.mlp.experts
            values = experts.dequantized() if isinstance(experts, PackedExperts) else (
                experts.gate_up_proj, experts.down_proj)
            for name, value in zip(("gate_up_proj", "down_proj"), values, strict=True):
                assert torch.equal(value, state[f"{prefix}mlp.experts.{name}"]), (i, name)


def _has(module: nn.Module, path: str) -> bool:
    try:
        module.get_submodule(path)
    except AttributeError:
        return False
    return True


def _hf_greedy(hf: nn.Module, prompts: list[list[int]], new: int) -> list[list[int]]:
    out = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            gen = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new,
                              min_new_tokens=new, pad_token_id=hf.config.eos_token_id)
            out.append(gen[0, len(prompt):].tolist())
    return out


@pytest.mark.parametrize("fmt", FORMATS)
def test_weights_and_greedy_match_transformers(family: tuple[str, Path], fmt: str) -> None:
    arch, directory = family
    file = write_family_gguf(directory, arch, fmt)
    hf = _transformers_model(file)
    ours = load_model(file)
    _assert_weights_equal(ours, hf)
    # Q8_0 stays packed (MoE experts too: tests/engine/model/test_gguf_moe_packed.py)
    assert isinstance(ours.model.layers[0].self_attn.qkv_proj, QuantLinear) == (fmt != "F32")
    if fmt != "F32":
        # packed Q8_0 runs int8 activations (not transformers' arithmetic): with them off, the
        # paged model's prefill and decode logits are transformers' on the same file
        assert_fp32_activation_logits_match(ours, hf)
        return
    prompts = [prompt_ids(n, seed) for seed, n in enumerate((7, 19, 12))]
    new = 10
    expected = _hf_greedy(hf, prompts, new)
    llm = LLM(str(file), dtype="float32", kv_cache_memory=16 << 20, block_size=8, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0.0, max_tokens=new, min_tokens=new)
    assert generated(llm.generate(prompts, params)) == expected
    assert_no_leaks(llm)


def test_dequantized_load_matches_too(family: tuple[str, Path]) -> None:
    """quantization='dequantize' (transformers' own load, then the HF-named copy) gives the same weights."""
    arch, directory = family
    file = write_family_gguf(directory, arch, "Q8_0")
    _assert_weights_equal(load_model(file, quantization="dequantize"), _transformers_model(file))


def test_partial_rotary_phi3_gguf_is_refused(tmp_path: Path) -> None:
    """transformers' phi3 GGUF config drops rope.dimension_count: a partial-rotary file is refused, not
    served with every head dim rotated."""
    directory = make_family_dir(tmp_path, "phi3", seed=1)
    with pytest.raises(ModelLoadError, match="phi3 GGUF with 12 of 16 head dims rotated"):
        load_model(write_family_gguf(directory, "phi3", "F32", rope_dims=12))


def test_rope_scaled_gemma3_gguf_is_refused(tmp_path: Path) -> None:
    """Gemma 3 4B+'s linear rope factor, which transformers' GGUF config drops: refused, not served unscaled."""
    _, arch, overrides = FAMILIES["gemma3"]
    directory = make_family_dir(tmp_path, "gemma3_text", seed=1, **overrides)
    with pytest.raises(ModelLoadError, match="gemma3 GGUF with rope scaling 'linear' is not supported"):
        load_model(write_family_gguf(directory, arch, "F32", rope_scaling=8.0))
