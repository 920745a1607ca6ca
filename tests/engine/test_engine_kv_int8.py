"""The int8 KV cache through the engine on SmolLM2: greedy generation under preemption (swap and
recompute, a small pool) and with prefix caching gives the tokens of a roomy int8 pool, every
block comes back, and a pool of the same bytes holds >= 1.9x the tokens of bf16."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.sampling_params import SamplingParams
from engine.llm import LLM
from engine.model.capacity import resolve_model_dtype
from engine.model.kv_cache import kv_bytes_per_block
from tests.engine.helpers import assert_no_leaks, generated, smollm2_prompt_ids

NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
POOL = 64 << 20


@pytest.fixture(scope="module")
def prompts(smollm2_dir: Path) -> list[list[int]]:
    return smollm2_prompt_ids(smollm2_dir)[:6]


@pytest.fixture(scope="module")
def roomy(smollm2_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    llm = LLM(str(smollm2_dir), dtype="float32", kv_cache_dtype="int8", kv_cache_memory=POOL)
    out = generated(llm.generate(prompts, GREEDY))
    again = generated(llm.generate(prompts, GREEDY))  # the prompts' blocks now come from the prefix cache
    assert again == out and llm.stats()["prefix_hits"] > 0
    assert_no_leaks(llm)
    return out


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_int8_greedy_under_preemption_matches_a_roomy_pool(smollm2_dir: Path, prompts: list[list[int]],
                                                           roomy: list[list[int]], mode: str) -> None:
    llm = LLM(str(smollm2_dir), dtype="float32", kv_cache_dtype="int8", num_gpu_blocks=14, num_cpu_blocks=200,
              preemption_mode=mode)
    assert llm.engine.runner.kv_caches[0][0].dtype == torch.int8
    assert llm.engine.runner.cpu_caches[0][0].shape[1:] == llm.engine.runner.kv_caches[0][0].shape[1:]
    assert generated(llm.generate(prompts, GREEDY)) == roomy
    assert llm.stats()["preemptions"].get(mode, 0) > 0, "the small pool was meant to force preemption"
    assert_no_leaks(llm)


def test_same_bytes_hold_more_than_1_9x_the_tokens_of_bf16(smollm2_dir: Path) -> None:
    llm = LLM(str(smollm2_dir), dtype="float32", kv_cache_dtype="int8", kv_cache_memory=POOL, swap_space=0)
    blocks = llm.engine.block_manager.num_blocks
    held = sum(k.nbytes + v.nbytes for k, v in llm.engine.runner.kv_caches)
    assert held <= POOL and held == blocks * kv_bytes_per_block(llm.engine.hf_config, 16, torch.int8)
    bf16_blocks = POOL // kv_bytes_per_block(llm.engine.hf_config, 16, torch.bfloat16)
    assert blocks / bf16_blocks >= 1.9, (blocks, bf16_blocks)


def test_float_cache_of_another_dtype_is_refused(smollm2_dir: Path) -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype bfloat16 needs the model dtype"):
        LLM(str(smollm2_dir), dtype="float32", kv_cache_dtype="bfloat16", kv_cache_memory=POOL)


@pytest.mark.parametrize(("flags", "device", "want"), [
    ("fpu avx2 fma f16c", "cpu", "float32"),
    ("fpu avx512f avx512_bf16", "cpu", "bfloat16"),
    ("fpu avx512f amx_bf16 amx_tile", "cpu", "bfloat16"),
    ("fpu avx2", "cuda", "bfloat16"),
])
def test_dtype_auto_is_bf16_only_where_computed_natively(flags: str, device: str, want: str) -> None:
    cpuinfo = f"processor\t: 0\nflags\t\t: {flags}\n"
    assert resolve_model_dtype("auto", torch.device(device), cpuinfo) == want
    assert resolve_model_dtype("float32", torch.device(device), cpuinfo) == "float32"


@pytest.mark.parametrize(("flags", "want"), [
    ("fpu avx2 fma f16c", "float32"),
    ("fpu avx512f avx512_bf16", "float32"),  # bf16 dot products but no VBMI: the kernel is not built
    ("fpu avx512f avx512_bf16 avx512vbmi", "bfloat16"),  # the AVX512-BF16 kernel (Zen 4/5)
    ("fpu avx512f avx512_bf16 avx512vbmi amx_bf16 amx_tile", "bfloat16"),
])
def test_dtype_auto_for_quantized_weights_is_bf16_where_the_bf16_kernel_runs(flags: str, want: str) -> None:
    cpuinfo = f"processor\t: 0\nflags\t\t: {flags}\n"
    assert resolve_model_dtype("auto", torch.device("cpu"), cpuinfo, quantized_weights=True) == want


def test_quantized_weights_keep_fp32_activations_and_refuse_fp16() -> None:
    from engine.config import EngineConfig
    from engine.model.capacity import resolve_compute

    cpu = torch.device("cpu")
    assert resolve_compute(EngineConfig(model="m.gguf", dtype="bfloat16"), cpu) == (torch.float32, True)
    assert resolve_compute(EngineConfig(model="m.gguf", dtype="float32"), cpu) == (torch.float32, False)
    assert resolve_compute(EngineConfig(model="m.gguf", dtype="bfloat16", quantization="dequantize"),
                           cpu) == (torch.bfloat16, False)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        resolve_compute(EngineConfig(model="m.gguf", dtype="float16"), cpu)


def test_config_validates_kv_cache_dtype() -> None:
    from engine.config import EngineConfig

    assert EngineConfig(model="m", kv_cache_dtype="int8").kv_cache_dtype == "int8"
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(model="m", kv_cache_dtype="fp8")
