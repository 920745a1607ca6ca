"""The correctness oracle: greedy decoding through the engine equals Hugging Face generate()
token for token on SmolLM2 — also under preemption, with and without prefix caching, and
with chunked prefill."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from common.sampling_params import SamplingParams
from engine.llm import LLM
from tests.engine.helpers import assert_no_leaks, generated, hf_greedy, smollm2_prompt_ids

NEW_TOKENS = 64


@pytest.fixture(scope="module")
def prompts(smollm2_dir: Path) -> list[list[int]]:
    return smollm2_prompt_ids(smollm2_dir)


@pytest.fixture(scope="module")
def expected(smollm2_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    return hf_greedy(smollm2_dir, prompts, NEW_TOKENS)


# min_tokens masks EOS exactly as HF's min_new_tokens does, so all 64 positions are compared.
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
# 40 blocks of 16 tokens hold ~3 of the 8 sequences at full length: preemption is certain.
TINY_POOL = {"num_gpu_blocks": 40, "num_cpu_blocks": 400}


@pytest.mark.parametrize(
    "config",
    [
        pytest.param({}, id="plain"),
        pytest.param({"enable_prefix_caching": False}, id="no-prefix-cache"),
        pytest.param({**TINY_POOL, "preemption_mode": "recompute"}, id="recompute"),
        pytest.param({**TINY_POOL, "preemption_mode": "swap"}, id="swap"),
        pytest.param({**TINY_POOL, "preemption_mode": "recompute", "enable_prefix_caching": False},
                     id="recompute-no-prefix-cache"),
        pytest.param({"max_num_batched_tokens": 16}, id="chunked-prefill"),
    ],
)
def test_greedy_matches_hf(smollm2_dir: Path, prompts: list[list[int]], expected: list[list[int]],
                           config: dict[str, Any]) -> None:
    llm = LLM(str(smollm2_dir), dtype="float32", kv_cache_memory=256 << 20, **config)
    outputs = llm.generate(prompts, GREEDY)
    assert generated(outputs) == expected
    stats = llm.stats()
    if "num_gpu_blocks" in config:
        assert sum(stats["preemptions"].values()) > 0, "the small pool was meant to force preemption"
        assert config["preemption_mode"] in stats["preemptions"]
    assert_no_leaks(llm)


def test_prefix_cache_hits_on_repeated_prompts(smollm2_dir: Path, prompts: list[list[int]],
                                               expected: list[list[int]]) -> None:
    llm = LLM(str(smollm2_dir), dtype="float32", kv_cache_memory=256 << 20)
    llm.generate(prompts, GREEDY)
    again = llm.generate(prompts, GREEDY)
    assert generated(again) == expected
    assert llm.stats()["prefix_hits"] > 0
    assert_no_leaks(llm)
