"""Qwen3, Granite, OLMo 2, SmolLM3, Phi-3 and Gemma 3 (text) on the shared Llama layers: small
random fp32 models of each family give HF's teacher-forced logits through the paged cache (chunked
prefill, then decode) and the engine's greedy tokens equal HF generate's (chunked prefill, a prefix
hit); paths that do not implement a family's options (the fused CPU decoder, tensor
parallelism for OLMo 2 and Phi-3) refuse."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from common.sampling_params import SamplingParams
from engine.llm import LLM
from engine.model import (
    AttentionMetadata,
    LlamaForCausalLM,
    ModelLoadError,
    ModelSpec,
    UnsupportedModelError,
    allocate_kv_caches,
    load_model,
)
from engine.model.sharding import TPShard
from tests.engine.helpers import assert_bf16_within_hf_bf16, assert_no_leaks, generated, hf_greedy, hf_logits
from tests.engine.model.test_sliding_window import make_family_dir, prompt_ids
from tests.fixtures.models import PagedHarness, Seq

FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    # head_dim 24 while hidden / heads is 16: the projections are wider than the hidden size
    "qwen3": ("qwen3", {"head_dim": 24}),
    "qwen3-bias": ("qwen3", {"attention_bias": True, "tie_word_embeddings": True}),
    "granite": ("granite", {"embedding_multiplier": 4.0, "attention_multiplier": 0.11,
                            "residual_multiplier": 0.35, "logits_scaling": 2.5}),
    "olmo2": ("olmo2", {}),
    # transformers' default no_rope_layers for 4 layers: [1, 1, 1, 0] (every 4th layer without rotary)
    "smollm3": ("smollm3", {"num_hidden_layers": 4}),
    "smollm3-nope-first": ("smollm3", {"num_hidden_layers": 3, "no_rope_layers": [0, 1, 0]}),
    "phi3": ("phi3", {}),  # qkv_proj and gate_up_proj fused in the checkpoint
    # Phi-4-mini's shape: 12 of 16 head dims rotated, longrope (short factors up to position 64)
    "phi3-partial-longrope": ("phi3", {"original_max_position_embeddings": 64, "rope_parameters": {
        "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
        "short_factor": [1.0, 1.1, 1.3, 1.7, 2.2, 3.0], "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0],
        "original_max_position_embeddings": 64}}),
    # sliding and full layers with their own rope theta (the window past every test's length),
    # head_dim 32 and query_pre_attn_scalar 24: the softmax scale is not head_dim's
    "gemma3": ("gemma3_text", {"head_dim": 32, "query_pre_attn_scalar": 24, "sliding_window": 256,
                               "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                               "num_hidden_layers": 3}),
    # transformers rescales dynamic NTK only past max_position_embeddings: the default rotation here
    "llama-dynamic-rope": ("llama", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0,
                                                         "factor": 4.0}}),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    model_type, overrides = FAMILIES[request.param]
    return make_family_dir(tmp_path_factory.mktemp(request.param), model_type, seed=11, **overrides)


def test_spec_reads_each_family() -> None:
    from transformers import AutoConfig

    def spec(model_type: str, **kw: Any) -> ModelSpec:
        return ModelSpec.from_hf_config(AutoConfig.for_model(model_type, num_hidden_layers=4, **kw))

    qwen3 = spec("qwen3", head_dim=24)
    assert (qwen3.qk_norm, qwen3.head_dim, qwen3.qkv_bias) == ("head", 24, False)
    olmo2 = spec("olmo2")
    assert (olmo2.qk_norm, olmo2.post_norms) == ("projection", True)
    granite = spec("granite", embedding_multiplier=12.0, attention_multiplier=0.0078125, residual_multiplier=0.22,
                   logits_scaling=8.0)
    assert (granite.embedding_multiplier, granite.attention_multiplier, granite.residual_multiplier,
            granite.logits_scaling) == (12.0, 0.0078125, 0.22, 8.0)
    assert spec("smollm3").rope_layers == (True, True, True, False)
    assert all(not s.llama_layout for s in (qwen3, olmo2, granite, spec("smollm3")))
    assert spec("llama").llama_layout and spec("smollm3", no_rope_layers=[1, 1, 1, 1]).llama_layout
    gemma = spec("gemma3_text", hidden_size=64, num_attention_heads=4, head_dim=16, query_pre_attn_scalar=16,
                 layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
                 sliding_window=512)
    assert (gemma.activation, gemma.norm_offset, gemma.sandwich_norms, gemma.qk_norm) == (
        "gelu_pytorch_tanh", 1.0, True, "head")
    assert gemma.local_layers == (True, True, True, False) and gemma.sliding_window == 512
    assert (gemma.rope["rope_theta"], gemma.local_rope and gemma.local_rope["rope_theta"]) == (1e6, 1e4)
    assert (gemma.embedding_multiplier, gemma.attention_multiplier) == (8.0, 0.25)
    with pytest.raises(UnsupportedModelError, match="final_logit_softcapping"):
        spec("gemma3_text", final_logit_softcapping=30.0)
    # Qwen3's window applies where use_sliding_window is on (the kernels apply it, like Mistral's)
    assert spec("qwen3", sliding_window=24).sliding_window is None  # use_sliding_window off
    assert spec("qwen3", sliding_window=24, use_sliding_window=True, max_window_layers=0).sliding_window == 24
    # SmolLM3 slides on its NoPE layers when use_sliding_window is on
    assert spec("smollm3", sliding_window=24).sliding_window is None
    assert spec("smollm3", sliding_window=24, use_sliding_window=True).sliding_window == 24


def test_teacher_forced_logits_match_hf(family_dir: Path) -> None:
    tokens = prompt_ids(24, 5)
    reference = hf_logits(family_dir, tokens)
    model = load_model(family_dir)
    harness, seq = PagedHarness(model, seed=2), Seq(tokens)
    logits = [harness.step([(seq, 10)], []), harness.step([(seq, 6)], [])]
    logits += [harness.step([], [seq]) for _ in range(8)]
    torch.testing.assert_close(torch.cat(logits), reference, rtol=1e-4, atol=1e-4)
    assert model.fused_decoder() is None  # fp32 linears (and options the C++ decoder lacks): the modules


def test_prefill_without_a_cache_matches_hf(family_dir: Path) -> None:
    """The profiling pass: a whole prompt, every slot -1, no cache blocks (NoPE layers skip the write)."""
    tokens = prompt_ids(20, 8)
    model = load_model(family_dir)
    meta = AttentionMetadata(
        slot_mapping=torch.full((20,), -1, dtype=torch.int64), num_prefills=1, num_prefill_tokens=20,
        prefill_query_start=[0, 20], prefill_context_lens=[20],
        prefill_block_tables=torch.zeros((1, 1), dtype=torch.int32),
        decode_block_tables=torch.zeros((0, 1), dtype=torch.int32),
        decode_context_lens=torch.zeros(0, dtype=torch.int32),
    )
    hidden = model(torch.tensor(tokens), torch.arange(20), allocate_kv_caches(model, 0, 16, torch.float32, "cpu"),
                   meta)
    torch.testing.assert_close(model.compute_logits(hidden), hf_logits(family_dir, tokens), rtol=1e-4, atol=1e-4)


def test_bf16_error_is_within_hf_bf16s(family_dir: Path) -> None:
    """The paged model in bf16 against HF fp32: mean |logit error| at most 1.5x that of HF's own bf16
    (the bound of test_bf16_oracle; measured 0.97-1.01x over these families)."""
    assert_bf16_within_hf_bf16(family_dir, prompt_ids(40, 5))


def test_engine_greedy_matches_hf(family_dir: Path) -> None:
    prompts = [prompt_ids(n, seed) for seed, n in enumerate((7, 19, 12))]
    new = 12
    expected = hf_greedy(family_dir, prompts, new)
    params = SamplingParams(temperature=0.0, max_tokens=new, min_tokens=new)
    llm = LLM(str(family_dir), dtype="float32", kv_cache_memory=16 << 20, block_size=8, max_num_batched_tokens=16)
    assert generated(llm.generate(prompts, params)) == expected
    assert generated(llm.generate(prompts, params)) == expected
    assert llm.stats()["prefix_hits"] > 0
    assert_no_leaks(llm)


def test_qwen3_sliding_window_is_served_past_it(tmp_path: Path) -> None:
    directory = make_family_dir(tmp_path, "qwen3", seed=4, sliding_window=24, use_sliding_window=True,
                                max_window_layers=0)
    prompts = [prompt_ids(n, seed) for seed, n in enumerate((6, 15))]
    expected = [hf_greedy(directory, [p], 48 - len(p))[0] for p in prompts]
    params = [SamplingParams(temperature=0.0, max_tokens=48 - len(p), min_tokens=48 - len(p)) for p in prompts]
    assert LLM(str(directory), dtype="float32", kv_cache_memory=16 << 20).engine.max_model_len == 256
    llm = LLM(str(directory), dtype="float32", kv_cache_memory=16 << 20, max_model_len=48)
    assert generated(llm.generate(prompts, params)) == expected


def test_longrope_is_served_within_its_short_factors(tmp_path: Path) -> None:
    model_type, overrides = FAMILIES["phi3-partial-longrope"]
    directory = make_family_dir(tmp_path, model_type, seed=6, **overrides)
    llm = LLM(str(directory), dtype="float32", kv_cache_memory=16 << 20)
    assert llm.engine.max_model_len == 64
    prompt = prompt_ids(50, 3)  # 50 + 14 tokens: the last rotated position is 63
    params = SamplingParams(temperature=0.0, max_tokens=14, min_tokens=14)
    assert generated(llm.generate([prompt], params)) == hf_greedy(directory, [prompt], 14)
    with pytest.raises(ValueError, match="longrope's original_max_position_embeddings 64"):
        LLM(str(directory), dtype="float32", kv_cache_memory=16 << 20, max_model_len=128)


def test_an_empty_gguf_of_a_new_family_is_refused(tmp_path: Path) -> None:
    """Granite GGUF files are read (test_gguf_config_families.py); an empty one is a load error."""
    from transformers import AutoConfig

    spec = ModelSpec.from_hf_config(AutoConfig.for_model("granite", num_hidden_layers=2))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"")
    with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
        load_model(gguf, spec=spec)


def test_tensor_parallel_olmo2_is_refused() -> None:
    from transformers import AutoConfig

    spec = ModelSpec.from_hf_config(AutoConfig.for_model("olmo2", num_hidden_layers=2, hidden_size=64,
                                                         num_attention_heads=4, intermediate_size=128))
    with torch.device("meta"), pytest.raises(UnsupportedModelError, match="tensor parallelism is not supported"):
        LlamaForCausalLM(spec, TPShard(rank=0, size=2))


def test_tensor_parallel_phi3_is_refused() -> None:
    from transformers import AutoConfig

    spec = ModelSpec.from_hf_config(AutoConfig.for_model("phi3", num_hidden_layers=2, hidden_size=64,
                                                         num_attention_heads=4, intermediate_size=128))
    with torch.device("meta"), pytest.raises(UnsupportedModelError, match="qkv_proj and gate_up_proj fused"):
        LlamaForCausalLM(spec, TPShard(rank=0, size=2))


@pytest.mark.parametrize("family", ["qwen3", "granite", "smollm3-nope-first", "gemma3"])
def test_tensor_parallel_greedy_matches_hf(family: str, tmp_path: Path) -> None:
    """Two ranks (gloo, spawned): q/k norms over head_dim, multipliers and rope flags replicate,
    the projections split as Llama's."""
    model_type, overrides = FAMILIES[family]
    directory = make_family_dir(tmp_path, model_type, seed=13, **overrides)
    prompts = [prompt_ids(n, 40 + n) for n in (9, 21)]
    expected = hf_greedy(directory, prompts, 10)
    params = SamplingParams(temperature=0.0, max_tokens=10, min_tokens=10)
    with LLM(str(directory), dtype="float32", kv_cache_memory=16 << 20, tensor_parallel_size=2,
             tensor_parallel_threads=1) as llm:
        assert generated(llm.generate(prompts, params)) == expected
