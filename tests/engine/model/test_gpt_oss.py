"""gpt-oss served end to end: a small random fp32 checkpoint saved by transformers (GptOssConfig:
alternating sliding / full layers, yarn rope, q/k/v/o biases, attention sinks, the MoE block with
router bias and clamped SwiGLU experts) gives HF's teacher-forced logits through the paged cache
and the engine's greedy tokens equal HF generate's on prompts past the window, also with chunked
prefill, prefix hits and speculative decoding. Controls: with the sinks dropped the logits leave
HF's. MXFP4 experts dequantize at load to the same model; a rank holds its heads' sinks and its
share of the experts (served at TP=2: tests/engine/parallel/test_tp_moe.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from common.sampling_params import SamplingParams
from engine.llm import LLM
from engine.model import ModelSpec, UnsupportedModelError, load_model
from engine.model.gpt_oss import GptOssAttention, GptOssForCausalLM, dequantize_mxfp4, mxfp4_to_float
from engine.model.sharding import TPShard
from tests.engine.helpers import assert_bf16_within_hf_bf16, assert_no_leaks, generated, hf_greedy, hf_logits
from tests.engine.model.test_sliding_window import prompt_ids
from tests.fixtures.models import PagedHarness, Seq, _byte_tokenizer

WINDOW = 16
NEW_TOKENS = 24
TINY: dict[str, Any] = {
    "vocab_size": 320, "hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5, "initializer_range": 0.2, "tie_word_embeddings": False,
    "bos_token_id": 256, "eos_token_id": 259, "pad_token_id": 257,
    "num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": WINDOW, "swiglu_limit": 1.5,
    # yarn as gpt-oss ships it (truncate off), its ramp inside this model's short contexts
    "rope_parameters": {"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                        "original_max_position_embeddings": 32, "rope_theta": 150000.0},
}
PROMPTS = [prompt_ids(n, seed) for seed, n in enumerate((40, 9, 70))]  # past the window, within it
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)


def make_gpt_oss_dir(path: Path, seed: int = 0, **overrides: Any) -> Path:
    """A seeded random fp32 gpt-oss checkpoint; norms, biases and sinks drawn at random too (HF's
    init leaves them ones / zeros / small), so one read into the wrong place shows in the logits."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("gpt_oss", **{**TINY, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            elif name.endswith("sinks"):
                param.normal_(0.0, 1.5)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.2)
    model.save_pretrained(str(path))
    _byte_tokenizer().save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_gpt_oss_dir(tmp_path_factory.mktemp("gpt-oss"), seed=7)


@pytest.fixture(scope="module")
def expected(gpt_oss_dir: Path) -> list[list[int]]:
    return hf_greedy(gpt_oss_dir, PROMPTS, NEW_TOKENS)


def test_spec_reads_gpt_oss() -> None:
    from transformers import AutoConfig

    spec = ModelSpec.from_hf_config(AutoConfig.for_model("gpt_oss", **TINY))
    assert spec.attention_sinks and spec.qkv_bias and spec.o_bias and not spec.llama_layout
    assert spec.layer_windows == (WINDOW, 0, WINDOW, 0)  # layer_types: sliding, full, ...
    assert spec.rope["rope_type"] == "yarn" and spec.rope["truncate"] is False
    assert spec.moe is not None and spec.moe.router_bias and spec.moe.expert_bias and spec.moe.top_k == 2
    assert spec.moe.swiglu_limit == 1.5 and spec.moe.sparse_layers == (0, 1, 2, 3)
    full = ModelSpec.from_hf_config(AutoConfig.for_model("gpt_oss", **{**TINY, "layer_types": ["full_attention"] * 4}))
    assert full.sliding_window is None and full.layer_windows == (0, 0, 0, 0)


def _teacher_forced(model: GptOssForCausalLM, tokens: list[int]) -> torch.Tensor:
    """Logits of `tokens` through the paged cache: prefill chunks of 10 and 12, then one decode a token."""
    harness, seq = PagedHarness(model, seed=2), Seq(tokens)
    logits = [harness.step([(seq, 10)], []), harness.step([(seq, 12)], [])]
    logits += [harness.step([], [seq]) for _ in range(len(tokens) - 22)]
    return torch.cat(logits)


def test_teacher_forced_logits_match_hf(gpt_oss_dir: Path) -> None:
    tokens = prompt_ids(44, 5)  # past the window, in chunks and decodes
    reference = hf_logits(gpt_oss_dir, tokens)
    model = load_model(gpt_oss_dir)
    assert isinstance(model, GptOssForCausalLM)
    assert [layer.self_attn.attn.window for layer in model.model.layers] == [WINDOW, 0, WINDOW, 0]
    torch.testing.assert_close(_teacher_forced(model, tokens), reference, rtol=1e-4, atol=1e-4)
    assert model.fused_decoder() is None


def test_dropping_the_sinks_changes_the_logits(gpt_oss_dir: Path) -> None:
    """The control: the same model with every sink at -inf (no sink in the denominator) leaves HF's logits."""
    tokens = prompt_ids(44, 5)
    reference = hf_logits(gpt_oss_dir, tokens)
    model = load_model(gpt_oss_dir)
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            assert isinstance(attn, GptOssAttention)
            attn.sinks.fill_(float("-inf"))
    assert (_teacher_forced(model, tokens) - reference).abs().max() > 1e-2


@pytest.mark.parametrize("config", [
    {},
    {"block_size": 8, "max_num_batched_tokens": 8},  # chunked prefill, chunks shorter than the window
    {"block_size": 16, "max_num_batched_tokens": 24},
], ids=["whole", "chunks-of-8", "chunks-of-24"])
def test_engine_greedy_equals_hf(gpt_oss_dir: Path, expected: list[list[int]], config: dict[str, Any]) -> None:
    llm = LLM(str(gpt_oss_dir), dtype="float32", kv_cache_memory=16 << 20, **config)
    assert generated(llm.generate(PROMPTS, GREEDY)) == expected
    assert generated(llm.generate(PROMPTS, GREEDY)) == expected  # the prompts now hit the prefix cache
    assert llm.stats()["prefix_hits"] > 0
    assert_no_leaks(llm)


def test_engine_without_sinks_answers_otherwise(gpt_oss_dir: Path, expected: list[list[int]]) -> None:
    """The greedy control: the engine with every sink at -inf does not give HF's tokens."""
    llm = LLM(str(gpt_oss_dir), dtype="float32", kv_cache_memory=16 << 20)
    with torch.no_grad():
        for layer in llm.engine.model.model.layers:
            layer.self_attn.sinks.fill_(float("-inf"))
    assert generated(llm.generate(PROMPTS, GREEDY)) != expected


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_equals_hf(gpt_oss_dir: Path, expected: list[list[int]], mode: str) -> None:
    llm = LLM(str(gpt_oss_dir), dtype="float32", block_size=8, num_gpu_blocks=16, num_cpu_blocks=64,
              max_model_len=128, preemption_mode=mode)
    assert generated(llm.generate(PROMPTS, GREEDY)) == expected
    assert llm.stats()["preemptions"].get(mode, 0) > 0, "the small pool was meant to force preemption"
    assert_no_leaks(llm)


def test_bf16_error_is_within_hf_bf16s(gpt_oss_dir: Path) -> None:
    """The paged model in bf16 (sinks cast to fp32 for the kernels) against HF fp32: within 1.5x HF bf16's error."""
    assert_bf16_within_hf_bf16(gpt_oss_dir, prompt_ids(40, 5))


def test_speculative_decoding_equals_hf(gpt_oss_dir: Path) -> None:
    """ngram proposals verified through the same sink kernels: exact."""
    prompts = [[5, 6, 7, 8, 9] * 8, [33] * 30]
    want = hf_greedy(gpt_oss_dir, prompts, NEW_TOKENS)
    llm = LLM(str(gpt_oss_dir), dtype="float32", kv_cache_memory=16 << 20,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                                  "prompt_lookup_max": 3, "min_acceptance_rate": 0.0})
    assert generated(llm.generate(prompts, GREEDY)) == want
    assert llm.engine.stats()["spec"]["verified_rows"] > 0
    assert_no_leaks(llm)


def test_tensor_parallel_shards_sinks_and_experts() -> None:
    """Each rank holds its query heads' sinks and half of every expert (served: tests/engine/parallel/test_tp_moe.py);
    a size that does not divide the experts is refused."""
    from transformers import AutoConfig

    spec = ModelSpec.from_hf_config(AutoConfig.for_model("gpt_oss", **TINY))
    with torch.device("meta"):
        rank1 = GptOssForCausalLM(spec, TPShard(rank=1, size=2))
    layer = rank1.model.layers[0]
    assert layer.self_attn.sinks.shape == (2,) and layer.mlp.experts.gate_up_proj.shape == (8, 32, 64)
    assert layer.mlp.experts.down_proj_bias is None  # added once, by rank 0
    odd = ModelSpec.from_hf_config(AutoConfig.for_model("gpt_oss", **{**TINY, "intermediate_size": 30}))
    with torch.device("meta"), pytest.raises(UnsupportedModelError, match="experts' intermediate size 30"):
        GptOssForCausalLM(odd, TPShard(rank=0, size=4))


def _random_mxfp4(shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MXFP4 `(blocks [E, R, G, 16], scales [E, R, G])` of a weight of HF shape `[E, G * 32, R]`."""
    e, cols, rows = shape
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (e, rows, cols // 32, 16), generator=gen, dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(122, 127, (e, rows, cols // 32), generator=gen, dtype=torch.int32).to(torch.uint8)
    return blocks, scales


def test_mxfp4_dequantizes_as_transformers() -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = _random_mxfp4((3, 64, 48), 1)
    ours = mxfp4_to_float(blocks, scales)
    assert ours.shape == (3, 64, 48)
    assert torch.equal(ours, convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    with pytest.raises(ValueError, match="without its _scales"):
        list(dequantize_mxfp4([("experts.down_proj_blocks", blocks)]))


def write_mxfp4_pair(source: Path, tmp: Path) -> tuple[Path, Path]:
    """`source` (a gpt-oss checkpoint directory) with random MXFP4 experts as blocks and scales, and
    the same experts dequantized by transformers' own conversion: two directories under `tmp`."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    (file,) = sorted(source.glob("*.safetensors"))
    tensors = load_file(str(file))
    packed, plain = dict(tensors), dict(tensors)
    for i, name in enumerate(n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))):
        blocks, scales = _random_mxfp4(tuple(tensors[name].shape), 10 + i)
        del packed[name]
        packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
        plain[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    out = []
    for label, weights in (("mxfp4", packed), ("plain", plain)):
        directory = tmp / label
        directory.mkdir()
        for extra in source.iterdir():
            if extra.suffix != ".safetensors":
                (directory / extra.name).write_bytes(extra.read_bytes())
        save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
        out.append(directory)
    return out[0], out[1]


def test_mxfp4_checkpoint_loads_as_its_dequantized_weights(gpt_oss_dir: Path, tmp_path: Path) -> None:
    """The experts of one checkpoint written as MXFP4 blocks and scales, and of another as their
    dequantized values (transformers' own conversion): the two load to the same logits."""
    mxfp4, plain = write_mxfp4_pair(gpt_oss_dir, tmp_path)
    outputs = [_teacher_forced(load_model(d), prompt_ids(30, 3)) for d in (mxfp4, plain)]
    assert torch.equal(outputs[0], outputs[1])
    assert not torch.equal(outputs[0], _teacher_forced(load_model(gpt_oss_dir), prompt_ids(30, 3)))


@pytest.mark.parametrize("window", [0, 5])
def test_profiling_pass_attends_with_sinks(window: int) -> None:
    """The engine's profiling pass (no cache: prompts over their own K/V) computes the sink softmax too."""
    from engine.model.attention import AttentionMetadata, PagedAttention
    from tests.ops.test_attention_sinks import hf_eager_with_sinks

    gen = torch.Generator().manual_seed(window)
    tokens = 12
    q, k, v = torch.randn(tokens, 4, 16, generator=gen), torch.randn(tokens, 2, 16, generator=gen), \
        torch.randn(tokens, 2, 16, generator=gen)
    sinks = torch.randn(4, generator=gen)
    empty = torch.zeros(0, 0, dtype=torch.int32)
    meta = AttentionMetadata(slot_mapping=torch.full((tokens,), -1), num_prefills=1, num_prefill_tokens=tokens,
                             prefill_query_start=[0, tokens], prefill_context_lens=[tokens],
                             prefill_block_tables=empty, decode_block_tables=empty,
                             decode_context_lens=torch.zeros(0, dtype=torch.int32))
    out = PagedAttention(4, 2, 16, 0.25, window)(q, k, v, (torch.empty(0), torch.empty(0)), meta, sinks=sinks)
    want = hf_eager_with_sinks(q, k, v, torch.arange(tokens), window, 0.25, sinks)
    torch.testing.assert_close(out.view(tokens, 4, 16), want, atol=1e-5, rtol=1e-5)
