"""A sliding window is never served wrong: the paged kernels attend to every cached token, so the
engine serves a windowed model only within its window (context clamped to it when max_model_len
is not given, a longer max_model_len refused at start-up), and there it equals HF generate."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from common.sampling_params import SamplingParams
from engine.config import EngineConfig
from engine.llm import LLM
from engine.model.spec import ModelSpec
from engine.sched.admission import RequestRejected
from tests.engine.helpers import assert_no_leaks, generated, hf_greedy
from tests.fixtures.models import _byte_tokenizer

WINDOW = 24
TINY: dict[str, Any] = {
    "vocab_size": 320, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5, "initializer_range": 0.2, "tie_word_embeddings": False,
    "bos_token_id": 256, "eos_token_id": 259, "pad_token_id": 257,
}


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


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_family_dir(tmp_path_factory.mktemp("mistral-window"), "mistral", seed=3, sliding_window=WINDOW)


def test_spec_reads_the_window_of_sliding_layers_only(tmp_path: Path) -> None:
    from transformers import AutoConfig

    def window(model_type: str, **kw: Any) -> int | None:
        return ModelSpec.from_hf_config(AutoConfig.for_model(model_type, **{**TINY, **kw})).sliding_window

    assert window("mistral", sliding_window=WINDOW) == WINDOW
    assert window("mistral", sliding_window=None) is None
    assert window("qwen2", sliding_window=WINDOW) is None  # use_sliding_window off
    assert window("qwen2", sliding_window=WINDOW, use_sliding_window=True, max_window_layers=0) == WINDOW
    # every layer below max_window_layers keeps full attention: none slides
    assert window("qwen2", sliding_window=WINDOW, use_sliding_window=True, max_window_layers=2) is None


def test_context_is_clamped_to_the_window_unless_asked_for() -> None:
    window = (WINDOW, f"the model's sliding window of {WINDOW} tokens")
    assert EngineConfig(model="m").resolve_max_model_len(256, window) == WINDOW
    assert EngineConfig(model="m").resolve_max_model_len(256, None) == 256
    assert EngineConfig(model="m").resolve_max_model_len(16, window) == 16  # the window never binds
    assert EngineConfig(model="m", max_model_len=20).resolve_max_model_len(256, window) == 20
    assert EngineConfig(model="m", max_model_len=WINDOW).resolve_max_model_len(256, window) == WINDOW
    with pytest.raises(ValueError, match=f"sliding window of {WINDOW} tokens"):
        EngineConfig(model="m", max_model_len=WINDOW + 1).resolve_max_model_len(256, window)


def test_engine_refuses_a_context_longer_than_the_window(mistral_dir: Path) -> None:
    with pytest.raises(ValueError, match=f"max_model_len 64 exceeds the model's sliding window of {WINDOW}"):
        LLM(str(mistral_dir), dtype="float32", kv_cache_memory=16 << 20, max_model_len=64)


def test_greedy_within_the_window_equals_hf(mistral_dir: Path) -> None:
    """Prompts of 5-12 tokens, generation up to the window: HF (windowed) and the engine (full
    attention) attend to the same tokens. Chunked prefill and a prefix hit on the second pass."""
    prompts = [prompt_ids(n, seed) for seed, n in enumerate((5, 12, 9))]
    params = [SamplingParams(temperature=0.0, max_tokens=WINDOW - len(p), min_tokens=WINDOW - len(p))
              for p in prompts]
    expected = [hf_greedy(mistral_dir, [p], WINDOW - len(p))[0] for p in prompts]
    llm = LLM(str(mistral_dir), dtype="float32", kv_cache_memory=16 << 20, block_size=8, max_num_batched_tokens=8)
    assert llm.engine.max_model_len == WINDOW
    assert generated(llm.generate(prompts, params)) == expected
    assert generated(llm.generate(prompts, params)) == expected
    assert llm.stats()["prefix_hits"] > 0
    assert_no_leaks(llm)


def test_requests_past_the_window_are_refused_or_stopped_at_it(mistral_dir: Path) -> None:
    llm = LLM(str(mistral_dir), dtype="float32", kv_cache_memory=16 << 20)
    with pytest.raises(RequestRejected, match=f"does not fit max_model_len {WINDOW}") as refused:
        llm.engine.add_request("long", prompt_ids(40, 0), SamplingParams(temperature=0.0, max_tokens=4))
    assert refused.value.code == "context_length_exceeded"
    prompt = prompt_ids(20, 1)  # 20 + 10 > 24: generation ends at the window, within exact attention
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=10, min_tokens=4))[0]
    assert out.outputs[0].finish_reason == "length"
    assert out.outputs[0].token_ids == hf_greedy(mistral_dir, [prompt], WINDOW - 20)[0]
    assert_no_leaks(llm)
