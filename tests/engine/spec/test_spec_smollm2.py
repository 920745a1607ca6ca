"""SmolLM2: greedy with n-gram speculation is token for token the output without it, on prompts
that repeat their context (so proposals are accepted), with a prefix-cache hit on the rerun."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.sampling_params import SamplingParams
from engine.llm import LLM
from tests.engine.helpers import assert_no_leaks, generated

PASSAGE = ("The paged attention kernel reads keys and values from a block table, so the cache never needs "
           "to be contiguous. Each sequence owns a list of blocks; blocks are shared copy-on-write.")
CODE = "def area(width, height):\n    return width * height\n\n\ndef perimeter(width, height):\n"
CONVERSATIONS = [
    [{"role": "user", "content": f"Repeat the following text exactly:\n\n{PASSAGE}"}],
    [{"role": "user", "content": f"Rename `width` to `w` in this code and print all of it:\n\n{CODE}"}],
]


def test_greedy_identical_with_speculation(smollm2_dir: Path) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=48)
    plain_llm = LLM(str(smollm2_dir), kv_cache_memory=64 << 20)
    plain = generated(plain_llm.chat(CONVERSATIONS, params))
    llm = LLM(str(smollm2_dir), kv_cache_memory=64 << 20,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4})
    assert generated(llm.chat(CONVERSATIONS, params)) == plain
    assert generated(llm.chat(CONVERSATIONS, params)) == plain  # a prefix-cache hit this time
    stats = llm.engine.stats()
    assert stats["prefix_hits"] > 0
    assert stats["spec"]["accepted_tokens"] > 0
    assert stats["spec"]["acceptance_rate"] > 0.5
    assert_no_leaks(llm)


@pytest.mark.long
def test_suffix_on_the_served_q4_1_file() -> None:
    """The GGUF that `up` serves: suffix speculation gives the same greedy tokens, and its 5-row
    verification steps stay on the chunk pool (quantized weights never reach oneDNN there)."""
    from engine.model.fetch import default_gguf_path
    from ops.parallel import openmp_rows, openmp_rows_for

    gguf = default_gguf_path()
    if not gguf.is_file():
        pytest.skip("the default model's GGUF is not fetched (run `pagedserve fetch-model`)")
    params = SamplingParams(temperature=0.0, max_tokens=48)
    plain = generated(LLM(str(gguf), kv_cache_memory=64 << 20).chat(CONVERSATIONS, params))
    llm = LLM(str(gguf), kv_cache_memory=64 << 20, speculative_config={"method": "suffix", "num_speculative_tokens": 4})
    assert openmp_rows() == openmp_rows_for(True)
    assert generated(llm.chat(CONVERSATIONS, params)) == plain
    stats = llm.engine.stats()
    assert stats["spec_method"] == "suffix" and stats["spec"]["accepted_tokens"] > 0
    assert_no_leaks(llm)
