"""Mixtral GGUF files: llama.cpp's `llama` architecture with `llama.expert_count` /
`expert_used_count`, the router `ffn_gate_inp` and stacked experts `ffn_{gate,up,down}_exps` (or the
older one tensor per expert, `ffn_gate.E`), Q/K rows permuted as for Llama. Written here from a seeded
random transformers Mixtral (4 experts, top-2, each router tilted so expert 0 takes most tokens) in F32
and Q8_0. Read as a `MixtralConfig` (softmax over all experts, top-k renormalised); the Q8_0 experts
stay packed (`PackedExperts`). The oracle is transformers' Mixtral holding the file's values: the F32
file's engine greedy is its generate; with fp32 activations the packed file's logits are its logits
within 1e-4 and its greedy tokens its generate."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from benchmarks.quality.quant_quality import greedy, set_int8_activations
from common.sampling_params import SamplingParams
from engine.llm import LLM
from engine.model import load_model
from engine.model.loader import ModelLoadError, load_hf_config
from engine.model.moe import Experts, SparseMoE
from engine.model.packed_experts import PackedExperts
from engine.model.quant_linear import QuantLinear
from tests.engine.helpers import argmax_greedy, assert_no_leaks, generated
from tests.engine.model.gguf_writing import assert_fp32_activation_logits_match, write_llama_gguf
from tests.engine.model.test_moe_families import _mlp_inputs
from tests.engine.model.test_sliding_window import TINY, prompt_ids
from tests.fixtures.models import _byte_tokenizer

gguf = pytest.importorskip("gguf")
PROMPTS = [prompt_ids(n, seed) for seed, n in enumerate((7, 19, 12))]
NEW = 10
# (format, per-expert tensors): the stacked layout in both formats, the older split one in Q8_0
CASES = [("F32", False), ("Q8_0", False), ("Q8_0", True)]


def make_mixtral(seed: int = 0) -> nn.Module:
    """A seeded random fp32 Mixtral: norms drawn, each layer's router tilted towards expert 0 along
    its inputs' mean (skewed routing: expert 0 takes most tokens)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("mixtral", **{**TINY, "intermediate_size": 64, "num_local_experts": 4,
                                                "num_experts_per_tok": 2, "sliding_window": None})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
        for i, x in _mlp_inputs(model, [prompt_ids(30, s) for s in range(3)]).items():
            mean = x.mean(0)
            model.model.layers[i].mlp.gate.weight[0] += 30.0 * mean / mean.norm()
    return model


def _oracle(model: nn.Module, state: dict[str, torch.Tensor]) -> nn.Module:
    """transformers' Mixtral of `model`'s config holding the file's values."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32).eval()
    hf.load_state_dict(state)
    return hf



@pytest.fixture(scope="module", params=CASES, ids=[f"{f}{'-split' if s else ''}" for f, s in CASES])
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, nn.Module, str]:
    fmt, split = request.param
    directory = tmp_path_factory.mktemp(f"mixtral-{fmt}")
    _byte_tokenizer().save_pretrained(str(directory))
    model = make_mixtral(seed=5)
    file = directory / "mixtral.gguf"
    return file, _oracle(model, write_llama_gguf(model, file, fmt, split_experts=split)), fmt


def _blocks(model: nn.Module) -> list[SparseMoE]:
    return [m for m in model.modules() if isinstance(m, SparseMoE)]


def test_config_is_mixtral(case: tuple[Path, nn.Module, str]) -> None:
    file, hf, _ = case
    config = load_hf_config(file)
    assert config.model_type == "mixtral"
    for name in ("num_local_experts", "num_experts_per_tok", "intermediate_size", "hidden_size",
                 "num_hidden_layers", "num_key_value_heads", "vocab_size", "tie_word_embeddings"):
        assert getattr(config, name) == getattr(hf.config, name), name
    assert config.sliding_window is None


def test_experts_hold_the_files_values_packed_where_quantized(case: tuple[Path, nn.Module, str]) -> None:
    """Every layer sparse; Q8_0 experts as `PackedExperts` (router fp32), F32 ones the fp32 `Experts`;
    each holds exactly the file's values."""
    file, hf, fmt = case
    ours = load_model(file)
    blocks, state = _blocks(ours), hf.state_dict()
    assert len(blocks) == ours.spec.num_layers and ours.spec.moe is not None and ours.spec.moe.norm_topk_prob
    for i, block in enumerate(blocks):
        if fmt == "F32":
            assert isinstance(block.experts, Experts)
            gate_up, down = block.experts.gate_up_proj, block.experts.down_proj
        else:
            assert isinstance(block.experts, PackedExperts)
            assert isinstance(ours.model.layers[i].self_attn.qkv_proj, QuantLinear)
            gate_up, down = block.experts.dequantized()
        assert torch.equal(gate_up, state[f"model.layers.{i}.mlp.experts.gate_up_proj"])
        assert torch.equal(down, state[f"model.layers.{i}.mlp.experts.down_proj"])
        assert torch.equal(block.gate.weight, state[f"model.layers.{i}.mlp.gate.weight"])


def test_routing_is_skewed(case: tuple[Path, nn.Module, str]) -> None:
    """The tilted routers send most tokens of the prompts to expert 0 (the packed kernels' many-row path)."""
    _, hf, _ = case
    for i, x in _mlp_inputs(hf, PROMPTS).items():
        top = torch.nn.functional.linear(x, hf.model.layers[i].mlp.gate.weight).topk(2, dim=-1).indices
        assert (top == 0).any(dim=-1).float().mean() > 0.7


def test_fp32_activation_logits_and_greedy_equal_transformers(case: tuple[Path, nn.Module, str]) -> None:
    """Int8 activations off: the paged logits over a prefill and decode are transformers' Mixtral's
    within 1e-4, and the greedy tokens its."""
    file, hf, _ = case
    ours = load_model(file)
    assert_fp32_activation_logits_match(ours, hf)
    set_int8_activations(ours, False)
    assert [greedy(ours, p, NEW) for p in PROMPTS] == [argmax_greedy(hf, p, NEW) for p in PROMPTS]


def test_f32_engine_greedy_equals_transformers(case: tuple[Path, nn.Module, str]) -> None:
    file, hf, fmt = case
    if fmt != "F32":
        pytest.skip("the engine's greedy on packed files runs int8 activations (checked above with fp32)")
    llm = LLM(str(file), kv_cache_memory=1 << 24, dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=NEW, min_tokens=NEW)
    assert generated(llm.generate(PROMPTS, params)) == [argmax_greedy(hf, p, NEW) for p in PROMPTS]
    assert_no_leaks(llm)


def test_dequantize_load_equals_the_packed_values(case: tuple[Path, nn.Module, str]) -> None:
    """`quantization="dequantize"` reads the same file into fp32 experts with the same logits."""
    file, hf, _ = case
    ours = load_model(file, quantization="dequantize")
    assert all(isinstance(b.experts, Experts) for b in _blocks(ours))
    assert_fp32_activation_logits_match(ours, hf)


@pytest.mark.parametrize(("metadata", "message"), [
    (lambda w: w.add_expert_feed_forward_length(32), "expert_feed_forward_length differs from feed_forward_length"),
    (lambda w: w.add_expert_shared_count(1), "shared experts or a gating function"),
])
def test_what_mixtral_does_not_have_is_refused(tmp_path: Path, metadata: Any, message: str) -> None:
    model = make_mixtral(seed=1)
    file = tmp_path / "refused.gguf"
    write_llama_gguf(model, file, "F32", metadata=metadata)
    with pytest.raises(ModelLoadError, match=message):
        load_model(file)
