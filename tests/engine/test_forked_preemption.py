"""A forked request (n = 3 seeded samples) preempted in a device pool it only just fits, with a
swap pool that holds it exactly or not at all, on a real tiny model (issue 43): it finishes with
the tokens a roomy pool gives, or is refused with a client error; it never stops the engine.

5 device blocks of 8 tokens, 4 taken by `filler` (1) and `forked` (a 17-token prompt, 3). At
forked's first token its 3 samples share the partial last block and need 2 copies, 1 is free:
forked is preempted, and `tail` arrives behind it. Swapped out (3 host blocks) forked once
needed 3 + 1 per sample = 6 blocks of 5 to come back, and the engine scheduled nothing, forever."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from common.sampling_params import SamplingParams
from engine.llm import LLM
from tests.engine.helpers import assert_no_leaks

FILLER = ([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
FORKED = ([40 + i for i in range(17)], SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True))
TAIL = ([9], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
MAX_STEPS = 200  # the whole run takes about 20 steps; a stopped scheduler fails here instead of hanging


Forked = tuple[list[int], SamplingParams]


def _run(llm: LLM, forked: Forked = FORKED) -> dict[str, dict[str, Any]]:
    """Add the three requests and step to the end (at most MAX_STEPS): per request its tokens by
    sample index, or its error and code."""
    engine = llm.engine
    engine.add_request("filler", *FILLER)
    engine.add_request("forked", *forked)
    results: dict[str, dict[str, Any]] = {}
    for step in range(MAX_STEPS):
        if step == 2:  # forked has forked (step 0) and been preempted (step 1): tail queues behind it
            engine.add_request("tail", *TAIL)
        if not engine.has_unfinished_requests():
            break
        for delta in engine.step():
            result = results.setdefault(delta.request_id, {"tokens": {}, "error": None, "code": None})
            for choice in delta.outputs:
                result["tokens"].setdefault(choice.index, []).extend(choice.token_ids)
            if delta.error is not None:
                result["error"], result["code"] = delta.error, delta.error_code
    assert not engine.has_unfinished_requests(), f"no end after {MAX_STEPS} steps: the scheduler stopped"
    assert_no_leaks(llm)
    return results


@pytest.fixture(scope="module")
def roomy(tiny_llama_dir: Path) -> dict[str, dict[str, Any]]:
    with LLM(str(tiny_llama_dir), block_size=8, kv_cache_memory=16 << 20, watermark=0.0) as llm:
        results = _run(llm)
        assert not llm.stats()["preemptions"]
    assert all(result["error"] is None for result in results.values())
    assert [len(tokens) for tokens in results["forked"]["tokens"].values()] == [6, 6, 6]
    return results


def _tight(model_dir: Path, num_cpu_blocks: int, prefix_caching: bool,
           forked: Forked = FORKED) -> tuple[dict[str, dict[str, Any]], Any]:
    with LLM(str(model_dir), block_size=8, num_gpu_blocks=5, num_cpu_blocks=num_cpu_blocks, watermark=0.0,
             preemption_mode="swap", enable_prefix_caching=prefix_caching) as llm:
        return _run(llm, forked), llm.stats()["preemptions"]


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix-cache", "no-prefix-cache"])
def test_swapped_out_with_an_exact_swap_pool_it_comes_back(tiny_llama_dir: Path, roomy: dict[str, dict[str, Any]],
                                                           prefix_caching: bool) -> None:
    results, preemptions = _tight(tiny_llama_dir, 3, prefix_caching)
    assert preemptions == {"swap": 1}
    assert results == roomy


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix-cache", "no-prefix-cache"])
def test_a_swap_pool_too_small_falls_back_to_recompute(tiny_llama_dir: Path, roomy: dict[str, dict[str, Any]],
                                                       prefix_caching: bool) -> None:
    """1 host block cannot hold the group: it is recomputed. Its samples share the prompt's 2
    full blocks again, found in the prefix cache or, without one, given by the first sample to
    the others, which wait for it to compute them; apart they would need 3 x 3 = 9 blocks of 5
    (once refused here with context_length_exceeded)."""
    results, preemptions = _tight(tiny_llama_dir, 1, prefix_caching)
    assert preemptions == {"recompute": 1}
    assert results == roomy


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix-cache", "no-prefix-cache"])
def test_beams_preempted_keep_the_roomy_pools_beams(tiny_llama_dir: Path, prefix_caching: bool) -> None:
    """Beam search (width 3) through the same squeeze: every beam must be scheduled in the step
    its search advances, also while recomputed beams wait for the first one's prompt blocks."""
    beams = ([40 + i for i in range(17)], SamplingParams(n=3, use_beam_search=True, temperature=0.0, max_tokens=6,
                                                          ignore_eos=True))
    with LLM(str(tiny_llama_dir), block_size=8, kv_cache_memory=16 << 20, watermark=0.0) as llm:
        want = _run(llm, beams)
        assert not llm.stats()["preemptions"]
    results, preemptions = _tight(tiny_llama_dir, 1, prefix_caching, beams)
    assert preemptions.get("recompute", 0) >= 1
    assert results == want and len(want["forked"]["tokens"]) == 3
