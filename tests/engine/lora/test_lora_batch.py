"""With adapters, a request's answer does not depend on its step (deterministic mode): an adapter
request alone, beside seven others of other adapters and the base model, and prefilled in chunks
gets the same tokens and logprobs bit for bit; and the prefix cache never shares K/V between
adapters (or with the base model)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from common.sampling_params import SamplingParams
from engine.llm import LLM
from engine.model.lora import LoRARequest
from tests.engine.helpers import assert_no_leaks
from tests.engine.lora.adapters import make_adapter
from tests.fixtures.models import make_tiny_model_dir

PARAMS = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2, prompt_logprobs=1)


@pytest.fixture(autouse=True)
def two_threads() -> Iterator[None]:
    """Two torch threads: a reduction torch splits between threads for few rows shows up only then."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("lora-batch"), hidden_size=96, intermediate_size=200,
                               num_attention_heads=6, num_key_value_heads=2, num_hidden_layers=2, seed=3)


@pytest.fixture(scope="module")
def adapters(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora-batch-adapters")
    return {f"a{i}": str(make_adapter(model_dir, root / f"a{i}", seed=20 + i, r=(1, 4, 8, 16)[i % 4]))
            for i in range(4)}


def _prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randrange(5, 90))] for _ in range(count)]


TARGET = _prompts(1, seed=7)[0] + list(range(40, 80))


def _answer(out: Any) -> tuple[Any, ...]:
    choice = out.outputs[0]
    return choice.token_ids, choice.logprobs, choice.cumulative_logprob, out.prompt_logprobs


def _llm(model_dir: Path, adapters: dict[str, str], **config: Any) -> LLM:
    return LLM(str(model_dir), dtype="float32", enable_lora=True, max_loras=4, max_lora_rank=16,
               lora_modules=adapters, kv_cache_memory=16 << 20, **config)


def test_adapter_rows_are_batch_invariant(model_dir: Path, adapters: dict[str, str]) -> None:
    names = [None, *adapters]
    loras = [LoRARequest(name) if name else None for name in names]
    with _llm(model_dir, adapters) as llm:
        alone = {name: _answer(llm.generate([TARGET], PARAMS, lora_request=lora)[0])
                 for name, lora in zip(names, loras, strict=True)}
        llm.reset_prefix_cache()
        others = _prompts(7, seed=8)
        for name, lora in zip(names, loras, strict=True):  # the target among 7 others of every adapter and none
            batch_loras = [lora] + [loras[(i + 1) % len(loras)] for i in range(7)]
            outs = llm.generate([TARGET, *others], PARAMS, lora_request=batch_loras)
            assert _answer(outs[0]) == alone[name], name
            llm.reset_prefix_cache()
        assert_no_leaks(llm)
    assert len({tuple(a[0]) for a in alone.values()}) == len(names)  # every adapter answers differently
    with _llm(model_dir, adapters, max_num_batched_tokens=16) as chunked:
        for name, lora in zip(names, loras, strict=True):
            assert _answer(chunked.generate([TARGET], PARAMS, lora_request=lora)[0]) == alone[name], name


def test_prefix_cache_is_not_shared_across_adapters(model_dir: Path, adapters: dict[str, str]) -> None:
    prompt = list(range(100, 164))  # four full blocks of 16
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    with _llm(model_dir, adapters) as llm:
        def cached(lora: LoRARequest | None) -> tuple[int | None, list[int]]:
            out = llm.generate([prompt], greedy, lora_request=lora)[0]
            return out.num_cached_tokens, out.outputs[0].token_ids

        base_first = cached(None)
        a0_first, a0_again = cached(LoRARequest("a0")), cached(LoRARequest("a0"))
        a1_first = cached(LoRARequest("a1"))
        base_again = cached(None)
        assert base_first[0] == 0 and a0_first[0] == 0 and a1_first[0] == 0  # nobody reuses another's K/V
        assert a0_again[0] == 48 and base_again[0] == 48  # each finds its own
        assert a0_again[1] == a0_first[1] and base_again[1] == base_first[1]
        assert len({tuple(t) for _, t in (base_first, a0_first, a1_first)}) == 3
