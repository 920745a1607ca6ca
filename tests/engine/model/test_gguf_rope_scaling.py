"""GGUF rope scaling: Llama 3.x files (llama.cpp's `rope_freqs.weight`, the per-frequency divisors its
converter writes for `llama3` rope scaling) and the `rope.scaling.*` keys (linear, YaRN), written here
from seeded random transformers Llamas whose config has that scaling, as llama.cpp's converter lays
them out. The oracle is transformers' model of the original config holding the file's values: the
engine's greedy tokens equal its generate (F32), the paged logits with fp32 activations its logits
within 1e-4 (F32, Q8_0, Q4_0); the same file without the tensor is served with plain rope and misses
(the check can fail). What does not map is refused by name."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from common.sampling_params import SamplingParams
from engine.llm import LLM
from engine.model import load_model
from engine.model.loader import ModelLoadError, load_hf_config
from engine.model.rope import rope_inv_freq
from tests.engine.helpers import assert_no_leaks, generated, hf_greedy
from tests.engine.model.gguf_writing import (
    assert_fp32_activation_logits_match,
    llama3_rope_freqs,
    write_llama_gguf,
)
from tests.engine.model.test_sliding_window import make_family_dir, prompt_ids

gguf = pytest.importorskip("gguf")
HEAD_DIM = 16  # TINY: hidden 64, 4 heads; rope wavelengths 6.3, 19.9, 62.8, 199, ... (theta 10000)
# original context 64: one frequency kept, two blended (wavelengths between 16 and 64), five divided
LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
LLAMA32 = LLAMA3 | {"factor": 32.0}  # Llama 3.2's factor
LINEAR = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 16.0, "beta_slow": 2.0}
PROMPTS = [prompt_ids(n, seed) for seed, n in enumerate((70, 9, 120))]  # past the original context
NEW_TOKENS = 10


def _model_dir(tmp: Path, rope: dict[str, Any], seed: int = 3) -> Path:
    return make_family_dir(tmp, "llama", seed=seed, rope_parameters=dict(rope))


def _oracle(model_dir: Path, state: dict[str, torch.Tensor] | None = None) -> nn.Module:
    """transformers' model of the checkpoint's own config (its rope scaling), holding `state` if given."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    if state is not None:
        hf.load_state_dict(state)
    return hf


def _write(model_dir: Path, fmt: str, name: str, rope_freqs: Any = None,
           metadata: Callable[[Any], None] | None = None) -> tuple[Path, dict[str, torch.Tensor]]:
    """The checkpoint as `name`.gguf beside it (its byte tokenizer there too), and the file's values."""
    file = model_dir / f"{name}.gguf"
    return file, write_llama_gguf(_oracle(model_dir), file, fmt, metadata=metadata, rope_freqs=rope_freqs)


def _yarn_keys(rope: dict[str, Any]) -> Callable[[Any], None]:
    """The keys llama.cpp's converter writes for a YaRN config."""
    def add(writer: Any) -> None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
        if "attention_factor" in rope:
            writer.add_rope_scaling_yarn_attn_factor(rope["attention_factor"])
    return add


def _linear_keys(writer: Any) -> None:
    writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    writer.add_rope_scaling_factor(LINEAR["factor"])


@pytest.fixture(scope="module", params=[LLAMA3, LLAMA32], ids=["factor8", "factor32"])
def llama3_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _model_dir(tmp_path_factory.mktemp("llama3"), request.param)


def test_rope_freqs_become_the_configs_freq_factors(llama3_dir: Path) -> None:
    """The file's divisors are the config's `freq_factors`, and the rotation they give is transformers'
    llama3 one (llama.cpp's semantics and transformers' agree on the file, to fp32 rounding)."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = AutoConfig.from_pretrained(str(llama3_dir))
    factors = llama3_rope_freqs(config.rope_parameters, HEAD_DIM)
    assert sorted(set(factors.tolist()))[0] == 1.0 and factors.max() == config.rope_parameters["factor"]
    assert ((factors > 1) & (factors < factors.max())).sum() == 2  # two blended frequencies
    file, _ = _write(llama3_dir, "F32", "llama3", rope_freqs=factors)
    rope = load_hf_config(file).rope_parameters
    assert rope["rope_type"] == "default" and rope["freq_factors"] == factors.tolist()
    ours, scale = rope_inv_freq(rope, HEAD_DIM, 256)
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    torch.testing.assert_close(ours, theirs.float(), rtol=1e-6, atol=0)
    assert scale == 1.0
    plain, _ = rope_inv_freq({"rope_theta": 10000.0}, HEAD_DIM, 256)
    assert (ours / plain).min() < 1 / 7  # the scaled frequencies are really scaled


def test_llama3_f32_engine_greedy_equals_transformers(llama3_dir: Path) -> None:
    """Prompts of 70 and 120 tokens (past the original 64) and a short one: the engine's greedy tokens
    from the F32 file are transformers' generate on the llama3-scaled checkpoint."""
    config_rope = _oracle(llama3_dir).config.rope_parameters
    file, _ = _write(llama3_dir, "F32", "greedy", rope_freqs=llama3_rope_freqs(config_rope, HEAD_DIM))
    llm = LLM(str(file), kv_cache_memory=1 << 24, dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    assert generated(llm.generate(PROMPTS, params)) == hf_greedy(llama3_dir, PROMPTS, NEW_TOKENS)
    assert_no_leaks(llm)


@pytest.mark.parametrize("fmt", ["F32", "Q8_0", "Q4_0"])
def test_llama3_logits_with_fp32_activations_equal_transformers(llama3_dir: Path, fmt: str) -> None:
    """Teacher-forced logits over a prefill and decode steps (38 positions, the blended and divided
    frequencies turning far from plain rope's) within 1e-4 of transformers' on the file's values."""
    config_rope = _oracle(llama3_dir).config.rope_parameters
    file, state = _write(llama3_dir, fmt, f"logits-{fmt}", rope_freqs=llama3_rope_freqs(config_rope, HEAD_DIM))
    assert_fp32_activation_logits_match(load_model(file), _oracle(llama3_dir, state))


def test_without_rope_freqs_the_logits_miss(llama3_dir: Path) -> None:
    """The same file without `rope_freqs.weight` reads as plain rope, and the check above fails on it."""
    file, state = _write(llama3_dir, "F32", "no-rope-freqs")
    assert "freq_factors" not in load_hf_config(file).rope_parameters
    with pytest.raises(AssertionError, match="Tensor-likes are not close"):
        assert_fp32_activation_logits_match(load_model(file), _oracle(llama3_dir, state))


@pytest.mark.parametrize(("rope", "keys"), [
    (LINEAR, _linear_keys),
    (YARN, _yarn_keys(YARN)),
    (YARN | {"attention_factor": 1.25}, _yarn_keys(YARN | {"attention_factor": 1.25})),
], ids=["linear", "yarn", "yarn-attention-factor"])
def test_scaling_keys_map_to_transformers_rope(tmp_path: Path, rope: dict[str, Any],
                                               keys: Callable[[Any], None]) -> None:
    """`rope.scaling.*` keys as the converter writes them become the checkpoint's rope parameters, and
    the paged logits (fp32) are transformers' within 1e-4; a file without the keys misses."""
    model_dir = _model_dir(tmp_path, rope)
    file, state = _write(model_dir, "Q8_0", "scaled", metadata=keys)
    read = load_hf_config(file).rope_parameters
    assert {k: v for k, v in read.items() if k != "truncate"} == rope
    assert_fp32_activation_logits_match(load_model(file), _oracle(model_dir, state))
    plain, state = _write(model_dir, "Q8_0", "plain")
    with pytest.raises(AssertionError, match="Tensor-likes are not close"):
        assert_fp32_activation_logits_match(load_model(plain), _oracle(model_dir, state))


def test_llama_cpp_attn_factor_multiplies_yarns_default(tmp_path: Path) -> None:
    """llama.cpp's own `rope.scaling.attn_factor` scales YaRN's default attention factor (0.1 ln f + 1)."""
    model_dir = _model_dir(tmp_path, YARN)
    file, _ = _write(model_dir, "F32", "attn", metadata=lambda w: (_yarn_keys(YARN)(w),
                                                                   w.add_rope_scaling_attn_factors(1.5)))
    rope = load_hf_config(file).rope_parameters
    assert rope["attention_factor"] == pytest.approx(1.5 * (0.1 * np.log(4.0) + 1.0))


@pytest.mark.parametrize(("metadata", "rope_freqs", "message"), [
    (lambda w: w.add_rope_scaling_type(gguf.RopeScalingType.LONGROPE), None,
     "a llama GGUF with rope scaling 'longrope' is not supported"),
    (lambda w: (_yarn_keys(YARN)(w), w.add_rope_scaling_yarn_log_mul(0.1)), None,
     "a llama GGUF with rope.scaling.yarn_log_multiplier is not supported"),
    (lambda w: (_yarn_keys(YARN)(w), w.add_rope_scaling_yarn_ext_factor(0.5)), None,
     "a llama GGUF with rope.scaling.yarn_ext_factor 0.5 is not supported"),
    (lambda w: (_yarn_keys(YARN | {"attention_factor": 1.2})(w), w.add_rope_scaling_attn_factors(2.0)), None,
     "both rope.scaling.yarn_attn_factor and attn_factor"),
    (lambda w: w.add_rope_scaling_alpha(1000.0), None, "a llama GGUF with rope.scaling.alpha is not supported"),
    (None, np.ones(4, dtype=np.float32), "rope_freqs.weight has 4 entries"),
], ids=["longrope", "yarn-log-multiplier", "yarn-ext-factor", "two-attention-factors", "ntk-alpha",
        "rope-freqs-size"])
def test_unmapped_rope_is_refused_by_name(tmp_path: Path, metadata: Callable[[Any], None] | None,
                                          rope_freqs: Any, message: str) -> None:
    model_dir = _model_dir(tmp_path, {"rope_type": "default", "rope_theta": 10000.0})
    file, _ = _write(model_dir, "F32", "refused", rope_freqs=rope_freqs, metadata=metadata)
    with pytest.raises(ModelLoadError, match=message):
        load_model(file)


def _family_keys(rope: dict[str, Any]) -> Callable[[Any], None]:
    """What the converter adds to a gguf_config family's file for `rope`: rope_freqs, or the scaling keys."""
    if rope["rope_type"] == "llama3":
        return lambda w: w.add_tensor("rope_freqs.weight", llama3_rope_freqs(rope, HEAD_DIM),
                                      raw_dtype=gguf.GGMLQuantizationType.F32)
    return _linear_keys if rope["rope_type"] == "linear" else _yarn_keys(rope)


@pytest.mark.parametrize(("family", "rope"), [("granite", LLAMA3), ("smollm3", YARN), ("olmo2", LINEAR)])
def test_config_families_read_their_rope(tmp_path: Path, family: str, rope: dict[str, Any]) -> None:
    """The families whose config gguf_config builds (Granite and SmolLM3 are llama.cpp LlamaModels and
    carry rope_freqs the same way) read rope_freqs and the scaling keys too: the F32 file's paged
    logits are transformers' on the scaled checkpoint."""
    from tests.engine.model.test_gguf_config_families import FAMILIES, write_llama_cpp_gguf

    model_dir = make_family_dir(tmp_path, family, seed=4, **FAMILIES[family], rope_parameters=dict(rope))
    file = write_llama_cpp_gguf(model_dir, family, lambda kind: "F32", extra=_family_keys(rope))
    ours = load_model(file)
    assert ours.spec.rope.get("freq_factors") is not None or ours.spec.rope["rope_type"] == rope["rope_type"]
    assert_fp32_activation_logits_match(ours, _oracle(model_dir))


def test_qwen3_linear_scaling_is_read(tmp_path: Path) -> None:
    """A file of a family whose config transformers reads (Qwen3) with `rope.scaling.*` keys: the
    scaling transformers' GGUF config drops is read, and the paged logits are transformers'."""
    from tests.engine.model.test_gguf_families import FAMILIES, write_family_gguf

    _, arch, overrides = FAMILIES["qwen3"]
    model_dir = make_family_dir(tmp_path, "qwen3", seed=2, **overrides, rope_parameters=dict(LINEAR))
    ours = load_model(write_family_gguf(model_dir, arch, "F32", rope_scaling=LINEAR["factor"]))
    assert ours.spec.rope["rope_type"] == "linear" and ours.spec.rope["factor"] == LINEAR["factor"]
    assert_fp32_activation_logits_match(ours, _oracle(model_dir))


def test_convert_refuses_what_transformers_would_read_as_another_model(llama3_dir: Path, tmp_path: Path) -> None:
    """`convert_gguf` goes through transformers' GGUF loader, which drops rope_freqs and the scaling
    keys: such files are refused by name before anything is written; a plain file passes the check."""
    from engine.model.convert import ConvertError, check_convertible

    config_rope = _oracle(llama3_dir).config.rope_parameters
    file, _ = _write(llama3_dir, "F32", "convert", rope_freqs=llama3_rope_freqs(config_rope, HEAD_DIM))
    with pytest.raises(ConvertError, match="rope_freqs"):
        check_convertible(file)
    linear_dir = _model_dir(tmp_path / "linear", LINEAR)
    scaled, _ = _write(linear_dir, "F32", "linear", metadata=_linear_keys)
    with pytest.raises(ConvertError, match="rope"):
        check_convertible(scaled)
    plain, _ = _write(linear_dir, "F32", "plain")
    check_convertible(plain)
