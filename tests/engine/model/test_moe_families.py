"""Qwen2-MoE, Qwen3-MoE and Mixtral served end to end: small random fp32 checkpoints saved by transformers give
HF's teacher-forced logits through the paged cache (chunked prefill, then decode) and the engine's
greedy tokens equal HF generate's (a batch, chunked prefill, a prefix hit), with routing balanced
and skewed towards one expert; a tensor-parallel split that does not divide the experts and GGUF files
of unmapped MoE types refuse."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from common.sampling_params import SamplingParams
from engine.llm import LLM
from engine.model import LlamaForCausalLM, ModelLoadError, ModelSpec, UnsupportedModelError, load_model
from engine.model.moe import SparseMoE
from engine.model.sharding import TPShard
from engine.model.spec import SUPPORTED_MODEL_TYPES
from tests.engine.helpers import assert_bf16_within_hf_bf16, assert_no_leaks, generated, hf_greedy, hf_logits
from tests.engine.model.test_sliding_window import prompt_ids
from tests.fixtures.models import PagedHarness, Seq, _byte_tokenizer

TINY: dict[str, Any] = {
    "vocab_size": 320, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "initializer_range": 0.2,
    "tie_word_embeddings": False, "bos_token_id": 256, "eos_token_id": 259, "pad_token_id": 257,
}
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    # layer 0 dense (mlp_only_layers), layer 1 sparse; head_dim 24 != hidden / heads
    "qwen3_moe": ("qwen3_moe", {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                "intermediate_size": 96, "mlp_only_layers": [0], "norm_topk_prob": True,
                                "head_dim": 24}),
    "qwen3_moe-no-renorm": ("qwen3_moe", {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                          "intermediate_size": 96, "norm_topk_prob": False,
                                          "attention_bias": True}),
    # the gated shared expert; layer 1 dense (mlp_only_layers); q/k/v biases
    "qwen2_moe": ("qwen2_moe", {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                "shared_expert_intermediate_size": 48, "intermediate_size": 96,
                                "mlp_only_layers": [1], "norm_topk_prob": False}),
    "mixtral": ("mixtral", {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32}),
}
SKEWED = "skewed"  # suffix of a model id: the router of every sparse layer tilted towards expert 0


def _mlp_inputs(model: Any, prompts: list[list[int]]) -> dict[int, torch.Tensor]:
    """Each sparse layer's MLP inputs `[tokens, hidden]` over `prompts` (HF forward, hooks)."""
    captured: dict[int, list[torch.Tensor]] = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        if hasattr(layer.mlp, "gate"):
            hooks.append(layer.mlp.register_forward_pre_hook(
                lambda _m, args, i=i: captured.setdefault(i, []).append(args[0].reshape(-1, args[0].shape[-1]))))
    with torch.no_grad():
        for p in prompts:
            model(torch.tensor([p]))
    for h in hooks:
        h.remove()
    return {i: torch.cat(xs) for i, xs in captured.items()}


def make_moe_dir(path: Path, name: str, seed: int = 0) -> Path:
    """A seeded random fp32 checkpoint of MODELS[name] (norms and biases drawn too); with the
    SKEWED suffix each sparse router is tilted towards expert 0 along its inputs' mean."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, overrides = MODELS[name.removesuffix("-" + SKEWED)]
    config = AutoConfig.for_model(model_type, **{**TINY, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if "norm" in pname:
                param.uniform_(0.5, 1.5)
            elif pname.endswith(".bias"):
                param.normal_(0.0, 0.2)
        if name.endswith(SKEWED):
            for i, x in _mlp_inputs(model, [prompt_ids(30, s) for s in range(3)]).items():
                mean = x.mean(0)
                model.model.layers[i].mlp.gate.weight[0] += 30.0 * mean / mean.norm()
    model.save_pretrained(str(path))
    _byte_tokenizer().save_pretrained(str(path))
    return path


@pytest.fixture(scope="module", params=[*sorted(MODELS), f"qwen3_moe-{SKEWED}", f"mixtral-{SKEWED}"])
def moe_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_moe_dir(tmp_path_factory.mktemp(request.param), request.param, seed=11)


def test_spec_reads_moe_families() -> None:
    from transformers import AutoConfig

    assert {"qwen3_moe", "mixtral"} <= set(SUPPORTED_MODEL_TYPES)
    qwen = ModelSpec.from_hf_config(AutoConfig.for_model("qwen3_moe", num_hidden_layers=4, decoder_sparse_step=2,
                                                         mlp_only_layers=[3]))
    assert qwen.moe is not None and qwen.moe.sparse_layers == (1,) and qwen.qk_norm == "head"
    assert [qwen.is_sparse(i) for i in range(4)] == [False, True, False, False] and not qwen.llama_layout
    mixtral = ModelSpec.from_hf_config(AutoConfig.for_model("mixtral", num_hidden_layers=3))
    assert mixtral.moe is not None and mixtral.moe.sparse_layers == (0, 1, 2) and mixtral.qk_norm is None
    assert not mixtral.llama_layout
    qwen2 = ModelSpec.from_hf_config(AutoConfig.for_model("qwen2_moe", num_hidden_layers=2))
    assert qwen2.moe is not None and qwen2.moe.shared_expert_size > 0 and qwen2.qkv_bias and not qwen2.o_bias
    assert qwen2.sliding_window is None  # use_sliding_window off
    gpt_oss = ModelSpec.from_hf_config(AutoConfig.for_model("gpt_oss", num_hidden_layers=2))
    assert gpt_oss.moe is not None and gpt_oss.attention_sinks  # served: test_gpt_oss.py
    # a Mixtral GGUF reads as a llama config with experts: refused, not served as a dense model
    with pytest.raises(UnsupportedModelError, match="8 experts"):
        ModelSpec.from_hf_config(AutoConfig.for_model("llama", num_hidden_layers=2, num_local_experts=8))


def test_teacher_forced_logits_match_hf(moe_dir: Path) -> None:
    tokens = prompt_ids(24, 5)
    reference = hf_logits(moe_dir, tokens)
    model = load_model(moe_dir)
    spec = model.spec
    assert spec.moe is not None
    assert [isinstance(layer.mlp, SparseMoE) for layer in model.model.layers] == [
        spec.is_sparse(i) for i in range(spec.num_layers)]
    harness, seq = PagedHarness(model, seed=2), Seq(tokens)
    logits = [harness.step([(seq, 10)], []), harness.step([(seq, 6)], [])]
    logits += [harness.step([], [seq]) for _ in range(8)]
    torch.testing.assert_close(torch.cat(logits), reference, rtol=1e-4, atol=1e-4)
    assert model.fused_decoder() is None  # fp32 linears and experts: the modules (the C++ decoder takes packed ones)


def test_bf16_error_is_within_hf_bf16s(moe_dir: Path) -> None:
    """The paged model in bf16 against HF fp32: mean |logit error| at most 1.5x that of HF's own bf16."""
    assert_bf16_within_hf_bf16(moe_dir, prompt_ids(40, 5))


def _share_of_expert_0(directory: Path) -> float:
    """The share of a 24-token prompt's tokens that layer 1's router (ours) sends to expert 0."""
    model = load_model(directory)
    block = model.model.layers[1].mlp
    assert isinstance(block, SparseMoE)
    taken: list[torch.Tensor] = []
    handle = block.register_forward_pre_hook(lambda _m, args: taken.append(block.route(args[0])[1]))
    harness, seq = PagedHarness(model, seed=2), Seq(prompt_ids(24, 5))
    harness.step([(seq, 24)], [])
    handle.remove()
    return float((torch.cat(taken) == 0).any(dim=1).float().mean())


def test_skewed_router_sends_most_tokens_to_one_expert(tmp_path: Path) -> None:
    """The skewed fixtures really skew: expert 0 is among the top 2 of 8 for most tokens (balanced: 2 in 8)."""
    balanced = _share_of_expert_0(make_moe_dir(tmp_path / "balanced", "qwen3_moe", seed=11))
    skewed = _share_of_expert_0(make_moe_dir(tmp_path / "skewed", f"qwen3_moe-{SKEWED}", seed=11))
    assert balanced < 0.5 and skewed >= 0.75, (balanced, skewed)


def test_engine_greedy_matches_hf(moe_dir: Path) -> None:
    prompts = [prompt_ids(n, seed) for seed, n in enumerate((7, 19, 12))]
    new = 12
    expected = hf_greedy(moe_dir, prompts, new)
    params = SamplingParams(temperature=0.0, max_tokens=new, min_tokens=new)
    llm = LLM(str(moe_dir), dtype="float32", kv_cache_memory=16 << 20, block_size=8, max_num_batched_tokens=16)
    assert generated(llm.generate(prompts, params)) == expected
    assert generated(llm.generate(prompts, params)) == expected
    assert llm.stats()["prefix_hits"] > 0
    assert_no_leaks(llm)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_tensor_parallel_split_that_does_not_divide_the_experts_is_refused(model_type: str) -> None:
    """Sharded MoE models are served by tests/engine/parallel/test_tp_moe.py; 30 features do not split 4 ways."""
    from transformers import AutoConfig

    size = "moe_intermediate_size" if model_type == "qwen3_moe" else "intermediate_size"
    spec = ModelSpec.from_hf_config(AutoConfig.for_model(model_type, **{**TINY, **MODELS[model_type][1], size: 30}))
    with torch.device("meta"), pytest.raises(UnsupportedModelError, match="experts' intermediate size 30"):
        LlamaForCausalLM(spec, TPShard(rank=0, size=4))


def test_tensor_parallel_engine_refuses_before_spawning(tmp_path: Path) -> None:
    import json

    directory = make_moe_dir(tmp_path, "qwen3_moe", seed=1)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "moe_intermediate_size": 30}))
    with pytest.raises(UnsupportedModelError, match="experts' intermediate size 30"):
        LLM(str(directory), dtype="float32", kv_cache_memory=16 << 20, tensor_parallel_size=4,
            tensor_parallel_threads=1)


@pytest.mark.parametrize(("model_type", "refusal"), [
    ("mixtral", "not a readable GGUF file"),  # mapped (test_gguf_mixtral.py)
    ("qwen3_moe", "not a readable GGUF file"),  # mapped (test_gguf_families.py): an empty file is a load error
])
def test_an_empty_gguf_of_a_moe_type_is_refused(model_type: str, refusal: str, tmp_path: Path) -> None:
    from transformers import AutoConfig

    spec = ModelSpec.from_hf_config(AutoConfig.for_model(model_type, num_hidden_layers=2))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"")
    with pytest.raises(ModelLoadError, match=refusal):
        load_model(gguf, spec=spec)


def test_checkpoint_missing_an_expert_is_refused(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    directory = make_moe_dir(tmp_path, "mixtral", seed=3)
    (file,) = directory.glob("*.safetensors")
    tensors = load_file(str(file))
    dropped = [n for n in tensors if ".experts." in n][:1]
    assert dropped
    save_file({n: t for n, t in tensors.items() if n not in dropped}, str(file), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="checkpoint lacks"):
        load_model(directory)
