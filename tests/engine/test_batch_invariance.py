"""A request's answer does not depend on its step (deterministic mode, the CPU default): one
request alone, beside up to 31 others, prefilled whole or in chunks of 16 to 512 tokens, and
preempted by swap or by recompute gets the same tokens and the same logprobs, bit for bit, with
fp32 and int8 KV caches. Shapes off the kernels' tile sizes (hidden 96, intermediate 200)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from common.sampling_params import SamplingParams
from engine.llm import LLM
from tests.engine.helpers import assert_no_leaks
from tests.fixtures.models import make_tiny_model_dir

NEW = 24
PARAMS = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=2, prompt_logprobs=1)


@pytest.fixture(autouse=True)
def two_threads() -> Iterator[None]:
    """Two torch threads whatever OMP_NUM_THREADS says (CI runs one a worker): a kernel or torch op
    that splits one row's work between threads when a step has few rows shows up only then."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("invariance"), hidden_size=96, intermediate_size=200,
                               num_attention_heads=6, num_key_value_heads=2, num_hidden_layers=3, seed=3)


def _prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randrange(5, 300))] for _ in range(count)]


TARGET = _prompts(1, seed=7)[0][:200] + list(range(40, 100))  # 260 tokens: several blocks and chunks
OTHERS = _prompts(31, seed=8)


def _answer(out: Any) -> tuple[Any, ...]:
    choice = out.outputs[0]
    return choice.token_ids, choice.logprobs, choice.cumulative_logprob, out.prompt_logprobs


def _run(model_dir: Path | str, batch: list[list[int]], **config: Any) -> tuple[list[tuple[Any, ...]], dict[str, int]]:
    """Every request's answer, and the engine's preemption counts (dtype float32 unless given)."""
    llm = LLM(str(model_dir), **{"dtype": "float32", **config})
    outs = llm.generate(batch, PARAMS)
    assert_no_leaks(llm)
    return [_answer(out) for out in outs], dict(llm.stats().get("preemptions", {}))


@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_one_request_gets_the_same_bits_in_any_step(model_dir: Path, kv: str) -> None:
    roomy = {"kv_cache_dtype": kv, "kv_cache_memory": 32 << 20}
    alone = _run(model_dir, [TARGET], **roomy)[0][0]
    for others in (1, 7, 31):
        assert _run(model_dir, [TARGET, *OTHERS[:others]], **roomy)[0][0] == alone, f"beside {others} others"
    for chunk in (16, 48, 512):
        assert _run(model_dir, [TARGET, *OTHERS[:3]], max_num_batched_tokens=chunk, **roomy)[0][0] == alone, \
            f"chunks of {chunk}"


@pytest.mark.parametrize("kv", ["auto", "int8"])
@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_changes_no_bit(model_dir: Path, kv: str, mode: str) -> None:
    batch = [TARGET, *OTHERS[:5]]
    roomy, _ = _run(model_dir, batch, kv_cache_dtype=kv, kv_cache_memory=32 << 20)
    tight, preemptions = _run(model_dir, batch, kv_cache_dtype=kv, num_gpu_blocks=24, num_cpu_blocks=200,
                              preemption_mode=mode)
    assert preemptions.get(mode, 0) > 0, "the small pool was meant to force preemption"
    assert tight == roomy


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_default_gguf_model_gets_the_same_bits_in_any_step(dtype: str) -> None:
    """`up`'s default: SmolLM2's Q4_1 GGUF (packed linears: int8 activations for decode rows, fp32
    prompt rows, or bf16 ones with bf16 linears, `dtype auto` where the CPU has the bf16 kernel) with
    the int8 KV cache, alone, in a batch, in chunks of 64 and recomputed."""
    from engine.model.fetch import default_gguf_path
    from ops.quant import bf16_kernel

    gguf = default_gguf_path()
    if not gguf.is_file():
        pytest.skip("the default model's GGUF is not fetched (run `pagedserve fetch-model`)")
    if dtype == "bfloat16" and bf16_kernel() is None:
        pytest.skip("no bf16 kernel on this CPU: bf16 linears run in torch, whose GEMM blocks by row count")
    config = {"dtype": dtype, "kv_cache_dtype": "int8"}
    batch = [TARGET, *OTHERS[:5]]
    roomy, _ = _run(gguf, batch, kv_cache_memory=64 << 20, **config)
    assert _run(gguf, [TARGET], kv_cache_memory=64 << 20, **config)[0][0] == roomy[0]
    chunked, _ = _run(gguf, batch, kv_cache_memory=64 << 20, max_num_batched_tokens=64, **config)
    assert chunked == roomy
    tight, preemptions = _run(gguf, batch, num_gpu_blocks=24, num_cpu_blocks=200, preemption_mode="recompute",
                              **config)
    assert preemptions.get("recompute", 0) > 0
    assert tight == roomy  # a recomputed sequence's generated tokens keep their decode rows' int8 activations
