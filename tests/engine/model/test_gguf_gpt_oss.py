"""gpt-oss GGUF files, written here from a seeded random transformers checkpoint as llama.cpp's
converter lays them out (experts split into `ffn_gate_exps` / `ffn_up_exps` `[E, I, H]` or fused
`ffn_gate_up_exps`, `ffn_down_exps [E, H, I]`, their biases split alike, `attn_sinks`, the router as
`ffn_gate_inp`, yarn under `rope.scaling.*`), experts in F32 or MXFP4: the config built from the
metadata is the checkpoint's, and the engine's greedy tokens equal HF generate on the checkpoint
(F32) or on its experts' MXFP4 values. MXFP4 experts stay packed (`PackedExperts`, the file's bytes):
with fp32 activations the paged logits are transformers' on those values and the dequantized load's,
greedy is transformers' generate, and with int8 activations a batch decodes as each prompt alone;
where they cannot run packed (quantization='dequantize', bf16) they are dequantized, the log says why."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from benchmarks.quality.quant_quality import greedy, set_int8_activations
from common.sampling_params import SamplingParams
from engine.llm import LLM
from engine.model import ModelSpec, load_model
from engine.model.llama import LlamaForCausalLM
from engine.model.loader import load_hf_config
from engine.model.moe import Experts, SparseMoE
from engine.model.packed_experts import PackedExperts
from tests.engine.helpers import assert_no_leaks, generated, hf_greedy
from tests.engine.model.gguf_writing import add_decoder_shape
from tests.engine.model.test_gpt_oss import make_gpt_oss_dir
from tests.engine.model.test_sliding_window import prompt_ids
from tests.fixtures.models import PagedHarness, Seq

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType
# llama.cpp's gpt-oss graph fixes the SwiGLU clamp at 7 (no key carries it): the checkpoint uses it
GPT_OSS = {"swiglu_limit": 7.0}
PROMPTS = [prompt_ids(n, seed) for seed, n in enumerate((40, 9, 27))]  # past the 16-token window, within it
NEW_TOKENS = 12


def write_gpt_oss_gguf(model_dir: Path, experts: str = "F32", fused: bool = False, name: str = "gpt-oss") -> Path:
    """`model_dir`'s gpt-oss checkpoint as llama.cpp's converter writes it; expert weights in `experts`
    (F32 or MXFP4), `fused`: one `ffn_gate_up_exps` (gate rows, then up rows) per layer."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(model_dir))
    hf = load_file(str(model_dir / "model.safetensors"))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT_OSS, config.num_hidden_layers)
    path = model_dir / f"{name}.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt-oss")
    add_decoder_shape(writer, config)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_expert_count(config.num_local_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_expert_feed_forward_length(config.intermediate_size)
    writer.add_sliding_window(config.sliding_window)
    rope = config.rope_parameters
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
    writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    writer.add_pad_token_id(config.pad_token_id)

    def add(tensor: str, data: torch.Tensor, fmt: str = "F32") -> None:
        array = data.float().contiguous().numpy()
        if fmt == "F32":
            writer.add_tensor(tensor, array, raw_dtype=T.F32)
        else:
            writer.add_tensor(tensor, gguf.quants.quantize(array, T[fmt]), raw_dtype=T[fmt])

    for hf_name, weight in hf.items():
        if ".mlp.experts." in hf_name:
            _add_experts(add, hf_name, weight, experts, fused)
            continue
        base, _, suffix = hf_name.rpartition(".")
        layer = base.split(".")[2] if base.startswith("model.layers.") else ""
        if hf_name.endswith("self_attn.sinks"):
            add(f"blk.{layer}.attn_sinks.weight", weight)
        elif ".mlp.router" in hf_name:
            add(f"blk.{layer}.ffn_gate_inp.{suffix}", weight)
        else:
            gguf_base = names.get_name(base)
            assert gguf_base is not None, hf_name
            add(f"{gguf_base}.{suffix}", weight)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_experts(add: Any, hf_name: str, weight: torch.Tensor, fmt: str, fused: bool) -> None:
    """One expert tensor of the checkpoint as the converter splits it (gate and up de-interleaved)."""
    layer = hf_name.split(".")[2]
    prefix = f"blk.{layer}."
    if hf_name.endswith("gate_up_proj"):  # [E, H, 2I], gate and up interleaved by column
        rows = weight.transpose(1, 2)
        gate, up = rows[:, ::2], rows[:, 1::2]
        if fused:
            add(prefix + "ffn_gate_up_exps.weight", torch.cat((gate, up), dim=1), fmt)
        else:
            add(prefix + "ffn_gate_exps.weight", gate, fmt)
            add(prefix + "ffn_up_exps.weight", up, fmt)
    elif hf_name.endswith("gate_up_proj_bias"):  # [E, 2I]
        gate, up = weight[..., ::2], weight[..., 1::2]
        if fused:
            add(prefix + "ffn_gate_up_exps.bias", torch.cat((gate, up), dim=-1))
        else:
            add(prefix + "ffn_gate_exps.bias", gate)
            add(prefix + "ffn_up_exps.bias", up)
    elif hf_name.endswith("down_proj"):  # [E, I, H] -> [E, H, I]
        add(prefix + "ffn_down_exps.weight", weight.transpose(1, 2), fmt)
    else:
        assert hf_name.endswith("down_proj_bias"), hf_name
        add(prefix + "ffn_down_exps.bias", weight)


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_gpt_oss_dir(tmp_path_factory.mktemp("gguf-gpt-oss"), seed=9, **GPT_OSS)


def _mxfp4_checkpoint(directory: Path, out: Path) -> Path:
    """`directory`'s checkpoint with every expert weight replaced by its MXFP4 values (quantized along
    the input dimension, as the GGUF stores them), saved to `out`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)

    def roundtrip(rows: torch.Tensor) -> torch.Tensor:
        array = rows.contiguous().numpy()
        return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(gguf.quants.quantize(array, T.MXFP4),
                                                                             T.MXFP4)))

    with torch.no_grad():
        for layer in model.model.layers:
            experts = layer.mlp.experts
            experts.gate_up_proj.copy_(roundtrip(experts.gate_up_proj.transpose(1, 2)).transpose(1, 2))
            experts.down_proj.copy_(roundtrip(experts.down_proj.transpose(1, 2)).transpose(1, 2))
    model.save_pretrained(str(out))
    AutoTokenizer.from_pretrained(str(directory)).save_pretrained(str(out))
    return out


def test_config_from_metadata_gives_the_checkpoints_spec(gpt_oss_dir: Path) -> None:
    from transformers import AutoConfig

    config = load_hf_config(write_gpt_oss_gguf(gpt_oss_dir))
    assert ModelSpec.from_hf_config(config) == ModelSpec.from_hf_config(AutoConfig.from_pretrained(str(gpt_oss_dir)))


def test_f32_greedy_equals_transformers(gpt_oss_dir: Path) -> None:
    file = write_gpt_oss_gguf(gpt_oss_dir)
    llm = LLM(str(file), dtype="float32", kv_cache_memory=16 << 20, block_size=8, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    assert generated(llm.generate(PROMPTS, params)) == hf_greedy(gpt_oss_dir, PROMPTS, NEW_TOKENS)
    assert_no_leaks(llm)


def test_fused_gate_up_experts_load_the_same_weights(gpt_oss_dir: Path) -> None:
    split = load_model(write_gpt_oss_gguf(gpt_oss_dir))
    fused = load_model(write_gpt_oss_gguf(gpt_oss_dir, fused=True, name="gpt-oss-fused"))
    reference = dict(split.named_parameters())
    for name, param in fused.named_parameters():
        assert torch.equal(param, reference[name]), name


@pytest.fixture(scope="module")
def mxfp4(gpt_oss_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The MXFP4-expert GGUF, and the checkpoint holding its values (transformers' oracle)."""
    file = write_gpt_oss_gguf(gpt_oss_dir, experts="MXFP4", name="gpt-oss-mxfp4")
    return file, _mxfp4_checkpoint(gpt_oss_dir, tmp_path_factory.mktemp("mxfp4"))


def _sparse_blocks(model: torch.nn.Module) -> list[SparseMoE]:
    return [m for m in model.modules() if isinstance(m, SparseMoE)]


def test_mxfp4_experts_give_transformers_greedy_on_their_values(mxfp4: tuple[Path, Path]) -> None:
    """The engine as served (packed experts, int8 activations on decode rows): transformers' greedy."""
    file, oracle = mxfp4
    expected = hf_greedy(oracle, PROMPTS, NEW_TOKENS)
    llm = LLM(str(file), dtype="float32", kv_cache_memory=16 << 20, block_size=8, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    assert generated(llm.generate(PROMPTS, params)) == expected
    assert_no_leaks(llm)


def test_mxfp4_experts_stay_packed_with_the_files_values(mxfp4: tuple[Path, Path]) -> None:
    """Every layer's experts are `PackedExperts` on the file's MXFP4 blocks (17 bytes per 32 weights, no
    fp32 copy), holding the oracle's values and biases (gate and up de-interleaved); the log says packed."""
    from safetensors.torch import load_file
    from structlog.testing import capture_logs

    file, oracle = mxfp4
    with capture_logs() as logs:
        ours = load_model(file)
    assert any(e["event"].startswith("gpt-oss GGUF: expert weights run packed") and e["formats"] == ["MXFP4"]
               for e in logs)
    state = load_file(str(oracle / "model.safetensors"))
    blocks = _sparse_blocks(ours)
    assert len(blocks) == ours.spec.num_layers
    for i, block in enumerate(blocks):
        experts = block.experts
        assert isinstance(experts, PackedExperts) and not isinstance(experts, Experts)
        assert [f.name for f in experts.formats] == ["MXFP4", "MXFP4"]  # gate/up one shard, down
        e, inter, hidden = experts.spec.num_experts, experts.spec.intermediate_size, experts.hidden_size
        shards = [t for _, t in experts.shards()]
        assert [t.dtype for t in shards] == [torch.uint8, torch.uint8]
        assert [t.numel() for t in shards] == [e * 2 * inter * hidden // 32 * 17, e * hidden * inter // 32 * 17]
        assert not any(p.numel() >= e * inter * hidden for p in experts.parameters())  # biases only
        prefix = f"model.layers.{i}.mlp.experts."
        columns = state[prefix + "gate_up_proj"].transpose(1, 2)  # [E, 2I, H], gate and up rows interleaved
        gate_up, down = experts.dequantized()
        assert torch.equal(gate_up, torch.cat([columns[:, ::2], columns[:, 1::2]], dim=1))
        assert torch.equal(down, state[prefix + "down_proj"].transpose(1, 2))
        bias = state[prefix + "gate_up_proj_bias"]
        assert experts.gate_up_proj_bias is not None and experts.down_proj_bias is not None
        assert torch.equal(experts.gate_up_proj_bias, torch.cat([bias[:, ::2], bias[:, 1::2]], dim=1))
        assert torch.equal(experts.down_proj_bias, state[prefix + "down_proj_bias"])


def test_fused_gate_up_mxfp4_experts_pack_the_same_blocks(gpt_oss_dir: Path, mxfp4: tuple[Path, Path]) -> None:
    """One `ffn_gate_up_exps` (gate rows, then up rows) packs the bytes the split gate and up tensors do."""
    split = load_model(mxfp4[0])
    fused = load_model(write_gpt_oss_gguf(gpt_oss_dir, experts="MXFP4", fused=True, name="gpt-oss-mxfp4-fused"))
    for ours, theirs in zip(_sparse_blocks(fused), _sparse_blocks(split), strict=True):
        assert isinstance(ours.experts, PackedExperts) and isinstance(theirs.experts, PackedExperts)
        reference = dict(theirs.experts.named_buffers()) | dict(theirs.experts.named_parameters())
        tensors = dict(ours.experts.named_buffers()) | dict(ours.experts.named_parameters())
        assert tensors.keys() == reference.keys() and len(tensors) == 4
        for name, tensor in tensors.items():
            assert torch.equal(tensor, reference[name]), name


@pytest.mark.parametrize(("kwargs", "why"), [({"quantization": "dequantize"}, "quantization='dequantize'"),
                                             ({"dtype": "bfloat16"}, "fp32 activations on the CPU")])
def test_experts_that_cannot_run_packed_are_dequantized_saying_why(mxfp4: tuple[Path, Path], kwargs: dict[str, Any],
                                                                   why: str) -> None:
    from structlog.testing import capture_logs

    file, _ = mxfp4
    with capture_logs() as logs:
        ours = load_model(file, **kwargs)
    [line] = [e for e in logs if e["event"].startswith("gpt-oss GGUF: expert weights")]
    assert "dequantized to fp32 at load" in line["event"] and why in line["event"] and line["formats"] == ["MXFP4"]
    assert all(type(b.experts) is Experts for b in _sparse_blocks(ours))


def _paged_logits(model: LlamaForCausalLM, tokens: list[int]) -> torch.Tensor:
    """Logits of a chunked prefill (10, then 4 tokens) and 10 decode steps through the paged cache."""
    harness, seq = PagedHarness(model, seed=2), Seq(tokens)
    logits = [harness.step([(seq, 10)], []), harness.step([(seq, 4)], [])]
    logits += [harness.step([], [seq]) for _ in range(10)]
    return torch.cat(logits)


def test_packed_fp32_activation_logits_equal_transformers_and_the_dequantized_load(mxfp4: tuple[Path, Path]) -> None:
    """With fp32 activations the packed experts' paged logits are within 1e-4 of transformers' on the
    MXFP4 values and of the dequantized load's, and greedy decoding is transformers' generate."""
    from transformers import AutoModelForCausalLM

    file, oracle = mxfp4
    ours = load_model(file)
    set_int8_activations(ours, False)
    assert all(isinstance(b.experts, PackedExperts) and not b.experts.int8_activations for b in _sparse_blocks(ours))
    dequantized = load_model(file, quantization="dequantize")
    hf = AutoModelForCausalLM.from_pretrained(str(oracle), dtype=torch.float32).eval()
    tokens = prompt_ids(24, 5)
    with torch.inference_mode():
        reference = hf(torch.tensor([tokens])).logits[0]
        got = _paged_logits(ours, tokens)
        torch.testing.assert_close(got, reference, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got, _paged_logits(dequantized, tokens), rtol=1e-4, atol=1e-4)
        assert [greedy(ours, p, NEW_TOKENS) for p in PROMPTS] == hf_greedy(oracle, PROMPTS, NEW_TOKENS)


def test_packed_experts_decode_a_batch_as_each_prompt_alone(mxfp4: tuple[Path, Path]) -> None:
    """Int8 activations (the default) on the packed experts: a batch of three with chunked prefill decodes
    token for token as each prompt alone."""
    file, _ = mxfp4
    llm = LLM(str(file), dtype="float32", kv_cache_memory=16 << 20, block_size=8, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    together = generated(llm.generate(PROMPTS, params))
    assert together == [generated(llm.generate([p], params))[0] for p in PROMPTS]
    assert_no_leaks(llm)
