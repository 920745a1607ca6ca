"""The fused decoder (`FusedDecoder`) on Qwen3's per-head q/k RMSNorm and on sparse MoE layers
(Qwen3-MoE, Qwen2-MoE with its gated shared expert, Mixtral, a model mixing dense and MoE layers), against
the module path: bit for bit the same logits over prefill chunks, a mixed step and decode rows, on
fp32 and int8 caches, with the prompt rows exact or not and the experts on int8 or fp32
activations; the files are tiny GGUFs written as llama.cpp lays them out, their routers tilted so
one expert takes most tokens. And what it does not implement it leaves to the modules."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

import ops
from benchmarks.quality.quant_quality import set_int8_activations
from engine.model.execution_policy import ExecutionPolicy
from engine.model.fused_decoder import FusedDecoder
from engine.model.layers import SwiGLU
from engine.model.llama import LlamaForCausalLM
from engine.model.loader import load_model
from engine.model.moe import SparseMoE
from engine.model.quant_linear import QuantLinear
from ops.quant import Q4_1, Q8_0, interleave
from ops.reference import quant as ref
from tests.engine.model.gguf_writing import write_llama_gguf
from tests.engine.model.test_gguf_families import write_family_gguf
from tests.engine.model.test_gguf_mixtral import make_mixtral
from tests.engine.model.test_gguf_moe_packed import MODELS, make_moe_model, write_moe_gguf
from tests.engine.model.test_sliding_window import make_family_dir
from tests.fixtures.models import _byte_tokenizer, mixed_schedule_logits

pytest.importorskip("gguf")

MOE_CASES = [("qwen3_moe", "Q4_0"), ("qwen3_moe", "Q8_0"), ("qwen2_moe", "Q4_1"), ("qwen3_moe-256", "Q4_K"),
             ("mixtral", "Q8_0")]


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # head_dim 128: transformers' GGUF config of qwen3 keeps Qwen3Config's default (test_gguf_families)
    return make_family_dir(tmp_path_factory.mktemp("qwen3"), "qwen3", seed=3, head_dim=128)


@pytest.fixture(scope="module", params=MOE_CASES, ids=[f"{m}-{f}" for m, f in MOE_CASES])
def moe_file(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    name, fmt = request.param
    directory = tmp_path_factory.mktemp(f"{name}-{fmt}")
    _byte_tokenizer().save_pretrained(str(directory))
    file = directory / "model.gguf"
    if name == "mixtral":
        write_llama_gguf(make_mixtral(seed=5), file, fmt)
    else:
        write_moe_gguf(make_moe_model(name, seed=5), file, MODELS[name][1], fmt)
    return file


def _load(file: Path, fused: bool, exact_prompt_rows: bool = True, int8_activations: bool = True,
          dense_layer: int | None = None, bf16: bool = False) -> LlamaForCausalLM:
    """The GGUF under a policy with the fused decoder on or off (and bf16 linears with `bf16`); with
    `dense_layer`, that layer's MLP replaced by a dense SwiGLU on packed Q4_1 / Q8_0 weights (a model
    mixing dense and MoE layers)."""
    policy = ExecutionPolicy(fused_decoder=fused, exact_prompt_rows=exact_prompt_rows, bf16_linears=bf16)
    model = load_model(file, policy=policy)
    if dense_layer is not None:
        hidden, inter = model.spec.hidden_size, 96
        gen = torch.Generator().manual_seed(7)
        gate_up = torch.randn(2 * inter, hidden, generator=gen) * 0.2
        down = torch.randn(hidden, inter, generator=gen) * 0.2
        packed, fmt = interleave(ref.quantize(gate_up, Q4_1.type_id), Q4_1)
        mlp = SwiGLU(hidden, inter, bias=False)
        setattr(mlp, "gate_up_proj", QuantLinear(hidden, [(fmt, packed)]))  # noqa: B010 (a Linear's slot)
        setattr(mlp, "down_proj", QuantLinear(inter, [(Q8_0, ref.quantize(down, Q8_0.type_id))]))  # noqa: B010
        model.model.layers[dense_layer].mlp = mlp
    if not int8_activations:
        set_int8_activations(model, False)
    return model


_run = mixed_schedule_logits


def _assert_equal(fused: list[torch.Tensor], modules: list[torch.Tensor]) -> None:
    for step, (x, y) in enumerate(zip(fused, modules, strict=True)):
        assert torch.equal(x, y), f"step {step}: max difference {(x - y).abs().max().item()}"


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.int8])
@pytest.mark.parametrize("exact_prompt_rows", [True, False])
@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_0"])
def test_qwen3_qk_norm_layers_equal_the_modules(qwen3_dir: Path, fmt: str, kv_dtype: torch.dtype,
                                                exact_prompt_rows: bool) -> None:
    file = qwen3_dir / f"qwen3-{fmt}.gguf"
    if not file.exists():
        write_family_gguf(qwen3_dir, "qwen3", fmt)
    model = _load(file, True, exact_prompt_rows)
    assert model.spec.qk_norm == "head" and model.fused_decoder() is not None
    unfused = _load(file, False, exact_prompt_rows)
    assert unfused.fused_decoder() is None
    _assert_equal(_run(model, kv_dtype), _run(unfused, kv_dtype))


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.int8])
@pytest.mark.parametrize("exact_prompt_rows", [True, False])
def test_moe_layers_equal_the_modules(moe_file: Path, kv_dtype: torch.dtype, exact_prompt_rows: bool) -> None:
    model = _load(moe_file, True, exact_prompt_rows)
    fused = model.fused_decoder()
    assert fused is not None and all(fused.moe_layers)
    _assert_equal(_run(model, kv_dtype), _run(_load(moe_file, False, exact_prompt_rows), kv_dtype))


def test_moe_experts_on_fp32_activations_equal_the_modules(moe_file: Path) -> None:
    """Int8 activations off after the load (the experts' flag is read per step), and a model whose
    first layer is dense beside MoE layers."""
    for kwargs in ({"int8_activations": False}, {"dense_layer": 0}):
        model = _load(moe_file, True, **kwargs)
        fused = model.fused_decoder()
        assert fused is not None
        if "dense_layer" in kwargs:
            assert fused.moe_layers == [0, *[1] * (model.spec.num_layers - 1)]
        _assert_equal(_run(model, torch.float32), _run(_load(moe_file, False, **kwargs), torch.float32))


@pytest.mark.skipif(not ops.quant.bf16_all_rows(), reason="bf16 linears take whole steps on AMX-BF16 only")
def test_bf16_linears_beside_the_experts_equal_the_modules(moe_file: Path) -> None:
    """bf16 linears (every dense linear of a step of many rows on AMX tiles, the shared expert's too;
    the experts keep their kernels, the routers fixed_gemm) on both paths alike."""
    model = _load(moe_file, True, bf16=True)
    assert model.fused_decoder() is not None
    fused = _run(model, torch.float32)
    _assert_equal(fused, _run(_load(moe_file, False, bf16=True), torch.float32))
    assert not torch.equal(fused[0], _run(_load(moe_file, True), torch.float32)[0])  # the prefill ran in bf16


def test_the_routing_is_skewed(moe_file: Path) -> None:
    """The files' routers send most tokens to expert 0 (groups of many rows and of one), as the
    equality tests above need to cover."""
    model = _load(moe_file, True)
    block = model.model.layers[0].mlp
    assert isinstance(block, SparseMoE)
    x = torch.randn(64, model.spec.hidden_size, generator=torch.Generator().manual_seed(0))
    x += 3.0 * block.gate.weight[0] / block.gate.weight[0].norm()
    with torch.inference_mode():
        _, experts = block.route(x)
    counts = torch.bincount(experts.reshape(-1), minlength=block.spec.num_experts)
    assert counts[0] > 32 and counts[1:].min() < counts[0]


def test_what_it_does_not_implement_runs_the_modules(moe_file: Path, qwen3_dir: Path) -> None:
    model = _load(moe_file, True)
    layers = list(model.model.layers)
    assert FusedDecoder.for_layers(layers, 1) is not None
    assert FusedDecoder.for_layers(layers, 2) is None  # tensor parallel
    assert load_model(moe_file, quantization="dequantize").fused_decoder() is None  # fp32 experts
    spec = model.spec
    assert spec.moe is not None and FusedDecoder.serves(spec)
    assert not FusedDecoder.serves(replace(spec, attention_sinks=True))  # gpt-oss
    assert not FusedDecoder.serves(replace(spec, moe=replace(spec.moe, expert_bias=True)))
    assert not FusedDecoder.serves(replace(spec, qk_norm="projection"))  # OLMo 2
    assert not FusedDecoder.serves(replace(spec, residual_multiplier=0.5))  # Granite
    block = layers[0].mlp
    assert isinstance(block, SparseMoE)
    block.spec = replace(block.spec, expert_bias=True)  # gpt-oss's experts: biases and the clamped SwiGLU
    assert FusedDecoder.for_layers(layers, 1) is None
    block.spec = replace(block.spec, expert_bias=False, activation="clamped_swiglu")
    assert FusedDecoder.for_layers(layers, 1) is None
