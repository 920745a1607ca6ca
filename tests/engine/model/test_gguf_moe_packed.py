"""Qwen3-MoE and Qwen2-MoE GGUF files with their experts kept packed (`PackedExperts`).

Tiny random models (4 experts, top-2, the router of every layer tilted so one expert takes most
tokens) written as llama.cpp's converter lays them out (stacked `ffn_{gate,up,down}_exps`, the
router `ffn_gate_inp`, Qwen2-MoE's shared expert, the expert sizes in `expert_feed_forward_length`)
in Q8_0, Q4_0, Q4_1 and Q4_K. The oracle is transformers' model of the file's config holding the
file's values (each tensor quantized and dequantized by the gguf package / our reference quantizers).
Checked: the experts stay packed (memory about the file's size), with fp32 activations the paged
logits are the oracle's (chunked prefill, then decode) and greedy is its generate; with int8 activations
(the default) each prompt's first token is the oracle's, a batch decodes as each prompt alone, and a
token's MoE output has the same bits alone and in a step where its expert takes hundreds of rows;
chunked prefill and swap / recompute preemption leave the tokens unchanged; experts in a format without
a kernel are dequantized at load with a log line."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from benchmarks.quality.quant_quality import greedy, set_int8_activations
from common.sampling_params import SamplingParams
from engine.llm import LLM
from engine.model import load_model
from engine.model.execution_policy import LinearRows
from engine.model.loader import load_hf_config
from engine.model.moe import Experts, SparseMoE, group_by_expert
from engine.model.packed_experts import PackedExperts
from engine.model.quant_linear import QuantLinear, all_linears_quantized
from ops.reference import formats, quantizers
from tests.engine.helpers import argmax_greedy, assert_no_leaks, generated
from tests.engine.model.gguf_writing import add_decoder_shape
from tests.engine.model.test_moe_families import _mlp_inputs
from tests.engine.model.test_sliding_window import prompt_ids
from tests.fixtures.models import PagedHarness, Seq, _byte_tokenizer

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType

BASE: dict[str, Any] = {
    "vocab_size": 320, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "initializer_range": 0.2, "tie_word_embeddings": False,
    "bos_token_id": 256, "eos_token_id": 259, "pad_token_id": 257, "num_experts": 4, "num_experts_per_tok": 2,
}
# name -> (HF model type, GGUF arch, config); K-quant files need every K a multiple of 256
MODELS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "qwen3_moe": ("qwen3_moe", "qwen3moe", {"hidden_size": 64, "head_dim": 32, "moe_intermediate_size": 64}),
    "qwen2_moe": ("qwen2_moe", "qwen2moe", {"hidden_size": 64, "moe_intermediate_size": 32,
                                            "shared_expert_intermediate_size": 64}),
    "qwen3_moe-256": ("qwen3_moe", "qwen3moe", {"hidden_size": 256, "head_dim": 64, "moe_intermediate_size": 256}),
}
CASES = [("qwen3_moe", "Q8_0"), ("qwen3_moe", "Q4_0"), ("qwen2_moe", "Q4_1"), ("qwen2_moe", "Q8_0"),
         ("qwen3_moe-256", "Q4_K")]
PROMPTS = [prompt_ids(n, seed) for seed, n in enumerate((7, 19, 12))]
NEW = 10


def _encode(data: np.ndarray, fmt: str) -> tuple[np.ndarray, np.ndarray]:
    """`(stored bytes, the values they hold)` of fp32 `data` (any rank, rows along the last axis) in `fmt`."""
    if fmt == "F32":
        return data, data
    if fmt in quantizers.QUANTIZERS:
        rows = torch.from_numpy(data.reshape(-1, data.shape[-1]))
        packed = quantizers.quantize(rows, fmt)
        values = formats.by_name(fmt).dequantize(packed).reshape(data.shape).numpy()
        return packed.numpy().reshape(*data.shape[:-1], -1), values
    packed = gguf.quants.quantize(data, T[fmt])
    return packed, gguf.quants.dequantize(packed, T[fmt]).reshape(data.shape)


def _gguf_tensors(state: dict[str, torch.Tensor], arch: str, layers: int) -> dict[str, tuple[str, torch.Tensor]]:
    """GGUF tensor name -> (HF name, fp32 values) as llama.cpp's converter names them (experts split)."""
    arch_id = next(key for key, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    names = gguf.get_tensor_name_map(arch_id, layers)
    out = {}
    for hf_name, value in state.items():
        base, _, suffix = hf_name.rpartition(".")
        if base.endswith("mlp.experts"):  # [E, 2I, H] gate then up rows; down [E, H, I]
            layer = hf_name.split(".")[2]
            if suffix == "gate_up_proj":
                gate, up = value.chunk(2, dim=1)
                out[f"blk.{layer}.ffn_gate_exps.weight"] = (hf_name + "#gate", gate)
                out[f"blk.{layer}.ffn_up_exps.weight"] = (hf_name + "#up", up)
            else:
                out[f"blk.{layer}.ffn_down_exps.weight"] = (hf_name, value)
            continue
        name = names.get_name(base)
        assert name is not None, hf_name
        out[f"{name}.{suffix}"] = (hf_name, value)
    return out


def write_moe_gguf(model: nn.Module, path: Path, arch: str, fmt: str, expert_fmt: str | None = None,
                   extra_keys: Callable[[Any], None] | None = None) -> dict[str, torch.Tensor]:
    """`model` as a GGUF at `path`: 2-D and 3-D weights in `fmt` (experts in `expert_fmt` if given),
    norms, biases and the shared-expert gate (one vector, as llama.cpp stores it) in F32;
    `extra_keys(writer)` adds metadata (a tokenizer). Returns the HF state dict holding the file's
    values (the oracle's weights)."""
    config = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    add_decoder_shape(writer, config)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(config.vocab_size)
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    writer.add_pad_token_id(config.pad_token_id)
    writer.add_expert_count(config.num_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if arch == "qwen2moe":
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    if extra_keys is not None:
        extra_keys(writer)
    values: dict[str, np.ndarray] = {}
    for name, (hf_name, value) in _gguf_tensors(model.state_dict(), arch, config.num_hidden_layers).items():
        data = value.detach().float().numpy()
        if name.endswith("ffn_gate_inp_shexp.weight"):
            data = data.reshape(-1)
        kind = fmt if data.ndim > 1 and "_exps" not in name else (expert_fmt or fmt) if data.ndim > 1 else "F32"
        stored, values[hf_name] = _encode(np.ascontiguousarray(data), kind)
        writer.add_tensor(name, stored, raw_dtype=T[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    state = {n: torch.from_numpy(np.ascontiguousarray(v)) for n, v in values.items() if "#" not in n}
    for n in {n.split("#")[0] for n in values if "#" in n}:
        state[n] = torch.cat([torch.from_numpy(values[n + "#gate"]), torch.from_numpy(values[n + "#up"])], dim=1)
    shapes = {n: t.shape for n, t in model.state_dict().items()}
    return {n: v.reshape(shapes[n]) for n, v in state.items()}


def make_moe_model(name: str, seed: int = 0) -> nn.Module:
    """A seeded random fp32 model of MODELS[name]: norms and biases drawn, each layer's router tilted
    towards expert 0 along its inputs' mean (expert 0 takes most tokens)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, _, overrides = MODELS[name]
    config = AutoConfig.for_model(model_type, **{**BASE, "intermediate_size": 96, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if "norm" in pname:
                param.uniform_(0.5, 1.5)
            elif pname.endswith(".bias"):
                param.normal_(0.0, 0.2)
        for i, x in _mlp_inputs(model, [prompt_ids(30, s) for s in range(3)]).items():
            mean = x.mean(0)
            model.model.layers[i].mlp.gate.weight[0] += 30.0 * mean / mean.norm()
    return model


def _oracle(file: Path, state: dict[str, torch.Tensor]) -> nn.Module:
    """transformers' model of the file's config (as pagedserve reads it) holding the file's values."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_config(load_hf_config(file), dtype=torch.float32).eval()
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"} - set(state), (missing, unexpected)
    return hf



@pytest.fixture(scope="module", params=CASES, ids=[f"{m}-{f}" for m, f in CASES])
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, nn.Module, str]:
    name, fmt = request.param
    directory = tmp_path_factory.mktemp(f"{name}-{fmt}")
    _byte_tokenizer().save_pretrained(str(directory))
    file = directory / "model.gguf"
    state = write_moe_gguf(make_moe_model(name, seed=5), file, MODELS[name][1], fmt)
    return file, _oracle(file, state), fmt


def _sparse_blocks(model: nn.Module) -> list[SparseMoE]:
    return [m for m in model.modules() if isinstance(m, SparseMoE)]


def _model_bytes(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def test_experts_stay_packed_with_the_files_values(case: tuple[Path, nn.Module, str]) -> None:
    file, hf, fmt = case
    ours = load_model(file)
    blocks = _sparse_blocks(ours)
    assert len(blocks) == ours.spec.num_layers
    # the eight-row layout QuantLinear holds too
    kernel_fmt = {"Q4_0": "Q4_0r8", "Q4_1": "Q4_1r8", "Q8_0": "Q8_0r8", "Q4_K": "Q4_Kr8"}.get(fmt, fmt)
    state = hf.state_dict()
    for i, block in enumerate(blocks):
        assert isinstance(block.experts, PackedExperts) and not isinstance(block.experts, Experts)
        assert [f.name for f in block.experts.formats] == [kernel_fmt, kernel_fmt]  # gate/up one shard, down
        gate_up, down = block.experts.dequantized()
        assert torch.equal(gate_up, state[f"model.layers.{i}.mlp.experts.gate_up_proj"])
        assert torch.equal(down, state[f"model.layers.{i}.mlp.experts.down_proj"])
        assert torch.equal(block.gate.weight, state[f"model.layers.{i}.mlp.gate.weight"])  # router: fp32
        assert isinstance(ours.model.layers[i].self_attn.qkv_proj, QuantLinear)
        if block.shared_expert is not None:
            assert isinstance(block.shared_expert.gate_up_proj, QuantLinear)
    # no fp32 linear runs oneDNN below 129 rows (routers on fixed_gemm): the engine keeps such steps on its chunk pool
    assert all_linears_quantized(ours)
    # the weights in memory are the file's size (fp32 norms and routers beside packed blocks), not 4 bytes a weight
    size = file.stat().st_size
    assert 0.8 * size < _model_bytes(ours) < 1.25 * size, (_model_bytes(ours), size)
    assert _model_bytes(ours) < 0.5 * sum(v.numel() * 4 for v in state.values())


def test_fp32_activation_logits_and_greedy_equal_transformers(case: tuple[Path, nn.Module, str]) -> None:
    """With int8 activations off (packed linears and experts), the paged model's logits over a chunked
    prefill and decode are the oracle's, and its greedy tokens are the oracle's generate."""
    file, hf, _ = case
    ours = load_model(file)
    set_int8_activations(ours, False)
    assert all(isinstance(b.experts, PackedExperts) and not b.experts.int8_activations for b in _sparse_blocks(ours))
    tokens = prompt_ids(24, 5)
    with torch.no_grad():
        reference = hf(torch.tensor([tokens])).logits[0]
    harness, seq = PagedHarness(ours, seed=2), Seq(tokens)
    logits = [harness.step([(seq, 10)], []), harness.step([(seq, 4)], [])]
    logits += [harness.step([], [seq]) for _ in range(10)]
    torch.testing.assert_close(torch.cat(logits), reference, rtol=1e-4, atol=1e-4)
    with torch.inference_mode():
        assert [greedy(ours, p, NEW) for p in PROMPTS] == [argmax_greedy(hf, p, NEW) for p in PROMPTS]


def _engine(file: Path, **kwargs: Any) -> LLM:
    pool = {} if "num_gpu_blocks" in kwargs else {"kv_cache_memory": 16 << 20}
    return LLM(str(file), dtype="float32", block_size=8, **pool, **kwargs)


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, min_tokens=NEW)


def test_engine_int8_first_tokens_and_batch_invariance(case: tuple[Path, nn.Module, str]) -> None:
    """Int8 activations (the default): each prompt's first token (prompt rows keep fp32 activations) is
    the oracle's; a batch of three, with chunked prefill, decodes token for token as each prompt alone."""
    file, hf, _ = case
    llm = _engine(file, max_num_batched_tokens=16)
    together = generated(llm.generate(PROMPTS, GREEDY))
    assert [t[0] for t in together] == [argmax_greedy(hf, p, 1)[0] for p in PROMPTS]
    assert together == [generated(llm.generate([p], GREEDY))[0] for p in PROMPTS]
    assert_no_leaks(llm)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_leaves_tokens_unchanged(case: tuple[Path, nn.Module, str], mode: str) -> None:
    file, _, fmt = case
    if fmt not in ("Q8_0", "Q4_K"):
        pytest.skip("one format of each model is enough for the scheduler's paths")
    prompts = [prompt_ids(n, seed) for seed, n in enumerate((40, 38, 42, 36))]
    expected = generated(_engine(file).generate(prompts, GREEDY))
    llm = _engine(file, num_gpu_blocks=12, num_cpu_blocks=64, max_model_len=64, preemption_mode=mode)
    assert generated(llm.generate(prompts, GREEDY)) == expected
    assert llm.stats()["preemptions"].get(mode, 0) > 0, "the small pool was meant to force preemption"
    assert_no_leaks(llm)


def _routed(block: SparseMoE, x: torch.Tensor, rows: LinearRows) -> torch.Tensor:
    """The block's routed experts alone (no shared expert) on `x`."""
    weights, experts = block.route(x)
    return block.experts(x, *group_by_expert(experts, weights, block.spec.num_experts), rows)


def test_a_tokens_moe_output_is_the_same_alone_and_in_a_crowd(case: tuple[Path, nn.Module, str]) -> None:
    """Each sparse block's routed experts on 300 rows (expert 0 takes most: past the dense kernels'
    128-row crossover to oneDNN) give every row the bits it gets alone, on int8 rows and on exact
    (fp32-activation) rows alike. (Qwen2-MoE's shared expert is a dense linear: per row only within
    `QUANT_GEMV_MAX_ROWS`, or in deterministic mode, as every dense linear.)"""
    file, _, _ = case
    ours = load_model(file)
    torch.manual_seed(0)
    for block in _sparse_blocks(ours):
        x = torch.randn(300, ours.spec.hidden_size) + 3.0 * block.gate.weight[0] / block.gate.weight[0].norm()
        _, experts = block.route(x)
        assert int((experts == 0).any(dim=1).sum()) > 150  # skewed: expert 0's group is past 128 rows
        for rows in (LinearRows(), LinearRows(exact_rows=300), LinearRows(exact_rows=140)):
            with torch.inference_mode():
                crowd = _routed(block, x, rows)
                alone = [_routed(block, x[i:i + 1], LinearRows(exact_rows=int(i < rows.exact_rows)))
                         for i in (0, 139, 140, 299)]
            for i, row in zip((0, 139, 140, 299), alone, strict=True):
                assert torch.equal(crowd[i:i + 1], row), (i, rows)


def test_grouping_matches_the_fp32_experts_on_the_same_values(tmp_path: Path) -> None:
    """`PackedExperts` with fp32 activations computes what `Experts` computes on the dequantized weights
    (same grouping, same order of the sum), to fp32 rounding."""
    model = make_moe_model("qwen3_moe", seed=2)
    file = tmp_path / "m.gguf"
    write_moe_gguf(model, file, "qwen3moe", "Q8_0")
    ours = load_model(file)
    block = _sparse_blocks(ours)[0]
    assert isinstance(block.experts, PackedExperts)
    block.experts.int8_activations = False
    fp32 = Experts(block.spec, ours.spec.hidden_size)
    gate_up, down = block.experts.dequantized()
    with torch.no_grad():
        fp32.gate_up_proj.copy_(gate_up)
        fp32.down_proj.copy_(down)
    x = torch.randn(40, ours.spec.hidden_size)
    weights, experts = block.route(x)
    grouped = group_by_expert(experts, weights, block.spec.num_experts)
    with torch.inference_mode():
        torch.testing.assert_close(block.experts(x, *grouped), fp32(x, *grouped), rtol=1e-5, atol=1e-5)


def test_experts_without_a_kernel_are_dequantized_with_a_log_line(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Q2_K experts, the table set to give Q2_K no kernel (as no format has one today), beside Q8_0
    layers: the experts run as fp32 `Experts` holding the file's values, the log says so, the rest
    stays packed, and greedy with fp32 activations is the oracle's."""
    from structlog.testing import capture_logs

    from tests.engine.model.test_gguf_formats import without_kernel

    without_kernel(monkeypatch, "Q2_K")

    _byte_tokenizer().save_pretrained(str(tmp_path))
    file = tmp_path / "model.gguf"
    state = write_moe_gguf(make_moe_model("qwen3_moe-256", seed=5), file, "qwen3moe", "Q8_0", expert_fmt="Q2_K")
    with capture_logs() as logs:
        ours = load_model(file)
    [line] = [e for e in logs if e["event"].startswith("MoE experts in a format without a kernel")]
    assert line["formats"] == {"Q2_K": 3 * ours.spec.num_layers}
    [summary] = [e for e in logs if e["event"] == "GGUF tensor formats"]
    assert f"Q2_K: {3 * ours.spec.num_layers} tensors, dequantized at load to float32" in summary["formats"]
    for i, block in enumerate(_sparse_blocks(ours)):
        assert type(block.experts) is Experts
        assert torch.equal(block.experts.gate_up_proj, state[f"model.layers.{i}.mlp.experts.gate_up_proj"])
        assert isinstance(ours.model.layers[i].self_attn.qkv_proj, QuantLinear)
    hf = _oracle(file, state)
    set_int8_activations(ours, False)
    with torch.inference_mode():
        assert [greedy(ours, p, NEW) for p in PROMPTS] == [argmax_greedy(hf, p, NEW) for p in PROMPTS]


def test_dequantized_load_holds_the_files_values(case: tuple[Path, nn.Module, str]) -> None:
    """quantization="dequantize" reads the same file (expert sizes from its keys, where transformers' own
    GGUF load keeps its defaults) into the fp32 `Experts`: the oracle's weights and logits."""
    file, hf, _ = case
    ours = load_model(file, quantization="dequantize")
    state = hf.state_dict()
    for i, block in enumerate(_sparse_blocks(ours)):
        assert type(block.experts) is Experts
        assert torch.equal(block.experts.gate_up_proj, state[f"model.layers.{i}.mlp.experts.gate_up_proj"])
        assert torch.equal(block.experts.down_proj, state[f"model.layers.{i}.mlp.experts.down_proj"])
    tokens = prompt_ids(20, 3)
    with torch.no_grad():
        reference = hf(torch.tensor([tokens])).logits[0]
    harness, seq = PagedHarness(ours, seed=1), Seq(tokens)
    logits = [harness.step([(seq, 12)], [])] + [harness.step([], [seq]) for _ in range(8)]
    # fp32 everywhere, other summation orders than transformers' (hidden 256: up to 1.4e-4 seen)
    torch.testing.assert_close(torch.cat(logits), reference, rtol=1e-4, atol=3e-4)
