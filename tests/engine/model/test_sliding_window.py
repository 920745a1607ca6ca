"""Sliding-window models served past their window: the paged kernels attend each query to the last
`sliding_window` positions (transformers' sliding mask) on the layers that slide (every layer of
Mistral; the `layer_types` ones of Qwen2/Qwen3 and Gemma 3), so the context is
max_position_embeddings and greedy decoding equals HF generate token for token in fp32, also with
chunked prefill, prefix hits, swap and recompute preemption, speculative decoding and the fused
CPU decoder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from common.sampling_params import SamplingParams
from engine.llm import LLM
from engine.model.spec import ModelSpec
from engine.worker.heartbeat import flatten_stats
from tests.engine.helpers import assert_no_leaks, generated, hf_greedy
from tests.fixtures.models import _byte_tokenizer

WINDOW = 16
TINY: dict[str, Any] = {
    "vocab_size": 320, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5, "initializer_range": 0.2, "tie_word_embeddings": False,
    "bos_token_id": 256, "eos_token_id": 259, "pad_token_id": 257,
}
# families whose windows differ per layer, each with a full and a sliding layer
LAYERED: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2": ("qwen2", {"sliding_window": WINDOW, "use_sliding_window": True, "max_window_layers": 1}),
    "qwen3": ("qwen3", {"sliding_window": WINDOW, "use_sliding_window": True,
                        "layer_types": ["sliding_attention", "full_attention"]}),
    "gemma3": ("gemma3_text", {"head_dim": 32, "query_pre_attn_scalar": 24, "sliding_window": WINDOW,
                               "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                               "num_hidden_layers": 3}),
}
NEW_TOKENS = 24


def make_family_dir(path: Path, model_type: str, seed: int = 0, **overrides: Any) -> Path:
    """A seeded random fp32 HF checkpoint of `model_type` (tiny sizes, `overrides` on top) with the
    byte-level tokenizer of tests.fixtures.models. Norm weights (HF: ones) and biases (zeros) are
    drawn at random too, so a norm or bias read into the wrong place shows in the logits."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **{**TINY, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.2)
    model.save_pretrained(str(path))
    _byte_tokenizer().save_pretrained(str(path))
    return path


def prompt_ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# prompts past the window (one over several of them), one within it that generates past it
PROMPTS = [prompt_ids(n, seed) for seed, n in enumerate((40, 9, 70))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_family_dir(tmp_path_factory.mktemp("mistral-window"), "mistral", seed=3, sliding_window=WINDOW)


@pytest.fixture(scope="module")
def mistral_expected(mistral_dir: Path) -> list[list[int]]:
    return hf_greedy(mistral_dir, PROMPTS, NEW_TOKENS)


def test_spec_reads_each_layers_window() -> None:
    from transformers import AutoConfig

    def spec(model_type: str, **kw: Any) -> ModelSpec:
        return ModelSpec.from_hf_config(AutoConfig.for_model(model_type, **{**TINY, **kw}))

    mistral = spec("mistral", sliding_window=WINDOW)
    assert (mistral.sliding_window, mistral.layer_windows, mistral.exact_context()) == (WINDOW, (WINDOW, WINDOW), None)
    assert spec("mistral", sliding_window=None).layer_windows == (0, 0)
    assert spec("mistral", sliding_window=256).layer_windows == (0, 0)  # spans max_position_embeddings: no bound
    assert spec("qwen2", sliding_window=WINDOW).layer_windows == (0, 0)  # use_sliding_window off
    # Qwen2: the layers from max_window_layers on slide
    def qwen2(first: int) -> ModelSpec:
        return spec("qwen2", sliding_window=WINDOW, use_sliding_window=True, max_window_layers=first)

    assert qwen2(1).layer_windows == (0, WINDOW) and qwen2(0).layer_windows == (WINDOW, WINDOW)
    assert qwen2(2).sliding_window is None and qwen2(2).layer_windows == (0, 0)
    assert spec("qwen3", sliding_window=WINDOW, use_sliding_window=True,
                layer_types=["full_attention", "sliding_attention"]).layer_windows == (0, WINDOW)
    gemma = spec("gemma3_text", sliding_window=WINDOW, num_hidden_layers=3,
                 layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    assert gemma.layer_windows == (WINDOW, 0, WINDOW) and gemma.local_layers == (True, False, True)


def test_context_is_max_position_embeddings(mistral_dir: Path) -> None:
    assert LLM(str(mistral_dir), dtype="float32", kv_cache_memory=16 << 20).engine.max_model_len == 256
    llm = LLM(str(mistral_dir), dtype="float32", kv_cache_memory=16 << 20, max_model_len=200)
    assert llm.engine.max_model_len == 200
    assert [layer.self_attn.attn.window for layer in llm.engine.model.model.layers] == [WINDOW, WINDOW]


@pytest.mark.parametrize("config", [
    {},
    {"block_size": 8, "max_num_batched_tokens": 8},  # chunked prefill, chunks shorter than the window
    {"block_size": 16, "max_num_batched_tokens": 24, "kv_cache_dtype": "float32"},
], ids=["whole", "chunks-of-8", "chunks-of-24"])
def test_mistral_greedy_past_the_window_equals_hf(mistral_dir: Path, mistral_expected: list[list[int]],
                                                  config: dict[str, Any]) -> None:
    llm = LLM(str(mistral_dir), dtype="float32", kv_cache_memory=16 << 20, **config)
    assert generated(llm.generate(PROMPTS, GREEDY)) == mistral_expected
    assert generated(llm.generate(PROMPTS, GREEDY)) == mistral_expected  # the prompts now hit the prefix cache
    assert llm.stats()["prefix_hits"] > 0
    assert_no_leaks(llm)


def test_the_window_matters(mistral_dir: Path, mistral_expected: list[list[int]]) -> None:
    """Without the window (every layer full) the same model answers otherwise: the comparisons
    above can fail."""
    llm = LLM(str(mistral_dir), dtype="float32", kv_cache_memory=16 << 20)
    for layer in llm.engine.model.model.layers:
        layer.self_attn.attn.window = 0
    llm.engine.block_manager.window = 0  # full attention reads every block: none may be released
    assert generated(llm.generate(PROMPTS, GREEDY)) != mistral_expected


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_past_the_window_equals_hf(mistral_dir: Path, mistral_expected: list[list[int]],
                                              mode: str) -> None:
    llm = LLM(str(mistral_dir), dtype="float32", block_size=8, num_gpu_blocks=16, num_cpu_blocks=64,
              max_model_len=128, preemption_mode=mode)
    assert generated(llm.generate(PROMPTS, GREEDY)) == mistral_expected
    assert llm.stats()["preemptions"].get(mode, 0) > 0, "the small pool was meant to force preemption"
    assert_no_leaks(llm)


def test_speculative_decoding_past_the_window_equals_hf(mistral_dir: Path) -> None:
    """Verified positions attend as decode rows (the same windowed kernel): exact."""
    prompts = [[5, 6, 7, 8, 9] * 8, [33] * 30]
    expected = hf_greedy(mistral_dir, prompts, NEW_TOKENS)
    llm = LLM(str(mistral_dir), dtype="float32", kv_cache_memory=16 << 20,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                                  "prompt_lookup_max": 3, "min_acceptance_rate": 0.0})
    assert generated(llm.generate(prompts, GREEDY)) == expected
    assert llm.engine.stats()["spec"]["verified_rows"] > 0
    assert_no_leaks(llm)


@pytest.mark.parametrize("family", sorted(LAYERED))
def test_layered_windows_past_the_window_equal_hf(family: str, tmp_path: Path) -> None:
    from transformers import AutoConfig

    model_type, overrides = LAYERED[family]
    directory = make_family_dir(tmp_path, model_type, seed=5, **overrides)
    windows = ModelSpec.from_hf_config(AutoConfig.from_pretrained(directory)).layer_windows
    assert 0 in windows and WINDOW in windows
    expected = hf_greedy(directory, PROMPTS, NEW_TOKENS)
    for config in ({}, {"block_size": 8, "max_num_batched_tokens": 8}):
        llm = LLM(str(directory), dtype="float32", kv_cache_memory=16 << 20, **config)
        assert generated(llm.generate(PROMPTS, GREEDY)) == expected, config
        assert generated(llm.generate(PROMPTS, GREEDY)) == expected, config
        assert llm.stats()["prefix_hits"] > 0
        assert_no_leaks(llm)


def test_fused_decoder_applies_each_layers_window(mistral_dir: Path) -> None:
    """The one-call C++ decoder (quantized linears) takes the layers' windows: bit for bit the
    module path, which differs from the same layers without windows."""
    from ops.quant import Q4_1
    from tests.engine.model.test_fused_decoder import _policy, _quantized, _run

    model = _quantized(mistral_dir, [Q4_1], True)
    fused = model.fused_decoder()
    assert fused is not None and fused.windows == [WINDOW, WINDOW]
    with_fused = _run(model, torch.float32)
    modules = _run(_quantized(mistral_dir, [Q4_1], True, policy=_policy(False)), torch.float32)
    for step, (x, y) in enumerate(zip(with_fused, modules, strict=True)):
        assert torch.equal(x, y), f"step {step}: max difference {(x - y).abs().max().item()}"
    for layer in model.model.layers:
        layer.self_attn.attn.window = 0
    fused.windows = [0, 0]
    assert not torch.equal(_run(model, torch.float32)[-1], with_fused[-1])


def test_tensor_parallel_past_the_window_equals_hf(mistral_dir: Path, mistral_expected: list[list[int]]) -> None:
    """Two ranks (gloo, spawned): each rank's heads take the layer's window."""
    with LLM(str(mistral_dir), dtype="float32", kv_cache_memory=16 << 20, tensor_parallel_size=2,
             tensor_parallel_threads=1, block_size=8, max_num_batched_tokens=24) as llm:
        assert generated(llm.generate(PROMPTS, GREEDY)) == mistral_expected


# ----- blocks behind the window go back to the pool ---------------------------------------------
STREAM_BS = 8
STREAM_TOKENS = 200
# a dozen streams, one prompt past the window, each growing far past it
STREAM_PROMPTS = [prompt_ids(n, 20 + seed) for seed, n in enumerate((9, 14, 5, 40, 7, 11, 6, 13, 8, 10, 12, 3))]
STREAM = SamplingParams(temperature=0.0, max_tokens=STREAM_TOKENS, min_tokens=STREAM_TOKENS)
# blocks a decoding sequence may hold: W positions span ceil(W / bs) + 1 blocks, +1 for up to bs
# speculative positions after them
STREAM_BOUND = -(-WINDOW // STREAM_BS) + 2


@pytest.fixture(scope="module")
def stream_expected(mistral_dir: Path) -> list[list[int]]:
    return hf_greedy(mistral_dir, STREAM_PROMPTS, STREAM_TOKENS)


def _generate_bounded(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[list[list[int]], int]:
    """Generate, and the most blocks any decoding sequence held in a step once the scheduler had
    released what lies behind its window (read right after each `schedule`)."""
    scheduler, manager = llm.engine.scheduler, llm.engine.block_manager
    schedule = scheduler.schedule
    most = 0

    def schedule_and_count() -> Any:
        nonlocal most
        out = schedule()
        for item in out.scheduled:
            if item.start >= item.seq.num_prompt_tokens:  # a decode row (a speculative one included);
                # a prompt's chunk holds the blocks admission gave its whole prompt
                most = max(most, manager.num_live_blocks(item.seq_id))
        return out

    scheduler.schedule = schedule_and_count  # type: ignore[method-assign]
    try:
        return generated(llm.generate(prompts, params)), most
    finally:
        scheduler.schedule = schedule  # type: ignore[method-assign]


def test_startup_reports_the_per_layer_bound(mistral_dir: Path) -> None:
    llm = LLM(str(mistral_dir), dtype="float32", kv_cache_memory=16 << 20, block_size=STREAM_BS)
    layers = llm.stats()["kv_layers"]
    assert layers["release_behind_window"] and layers["sliding_layers"] == 2 and layers["full_layer_tokens"] == 0
    assert layers["sliding_layer_tokens"] == WINDOW and layers["max_blocks_per_seq"] == STREAM_BOUND - 1
    assert llm.engine.block_manager.window == WINDOW
    beat = flatten_stats(llm.stats())  # what a heartbeat carries, and the /kv page shows
    assert beat["kv_layers_release_behind_window"] == 1.0 and beat["kv_layers_window"] == WINDOW
    assert beat["released_blocks"] == 0.0


@pytest.mark.parametrize("config", [
    {},
    {"max_num_batched_tokens": 8},  # chunked prefill
    {"num_gpu_blocks": 33, "num_cpu_blocks": 128, "preemption_mode": "swap"},
    {"num_gpu_blocks": 33, "preemption_mode": "recompute"},
], ids=["whole", "chunks-of-8", "swap", "recompute"])
def test_pool_stays_bounded_far_past_the_window(mistral_dir: Path, stream_expected: list[list[int]],
                                                config: dict[str, Any]) -> None:
    """Each stream grows 200 tokens past a 16-token window and holds at most `STREAM_BOUND` blocks
    of 8 while it decodes; greedy equals HF. 33 blocks hold one full-length stream (what admission
    asks), not twelve streams' windows (3-4 blocks each): with the past released the pool still
    preempts, and every stream's answer stays HF's."""
    llm = LLM(str(mistral_dir), dtype="float32", kv_cache_memory=16 << 20, block_size=STREAM_BS,
              max_model_len=256, **config)
    tokens, most = _generate_bounded(llm, STREAM_PROMPTS, STREAM)
    assert tokens == stream_expected
    assert most <= STREAM_BOUND, f"a decoding sequence held {most} blocks"
    stats = llm.stats()
    assert stats["released_blocks"] >= len(STREAM_PROMPTS) * (STREAM_TOKENS - WINDOW) // STREAM_BS
    if "preemption_mode" in config:
        assert stats["preemptions"].get(config["preemption_mode"], 0) > 0, "the pool was meant to be too small"
    assert_no_leaks(llm)
    if not config:  # again: the prompts' blocks (released, still cached) are hits now
        tokens, most = _generate_bounded(llm, STREAM_PROMPTS, STREAM)
        assert tokens == stream_expected and most <= STREAM_BOUND
        assert llm.stats()["prefix_hits"] > 0
        assert_no_leaks(llm)


def test_speculative_decoding_stays_bounded_past_the_window(mistral_dir: Path) -> None:
    prompts = [[5, 6, 7, 8, 9] * 8, [33] * 30, [40, 41] * 4]
    expected = hf_greedy(mistral_dir, prompts, STREAM_TOKENS)
    llm = LLM(str(mistral_dir), dtype="float32", kv_cache_memory=16 << 20, block_size=STREAM_BS,
              max_model_len=256,
              speculative_config={"method": "ngram", "num_speculative_tokens": STREAM_BS, "prompt_lookup_min": 1,
                                  "prompt_lookup_max": 3, "min_acceptance_rate": 0.0})
    tokens, most = _generate_bounded(llm, prompts, STREAM)
    assert tokens == expected
    assert most <= STREAM_BOUND, f"a decoding sequence held {most} blocks"
    assert llm.engine.stats()["spec"]["verified_rows"] > 0
    assert llm.stats()["released_blocks"] > 0
    assert_no_leaks(llm)


def test_mixed_windows_release_nothing(tmp_path: Path) -> None:
    """Gemma 3's full-attention layers read every block: the pool keeps them (and says so)."""
    model_type, overrides = LAYERED["gemma3"]
    llm = LLM(str(make_family_dir(tmp_path, model_type, seed=5, **overrides)), dtype="float32",
              kv_cache_memory=16 << 20, block_size=STREAM_BS)
    assert llm.engine.block_manager.window == 0 and not llm.stats()["kv_layers"]["release_behind_window"]
    llm.generate(PROMPTS[:1], GREEDY)
    assert llm.stats()["released_blocks"] == 0
