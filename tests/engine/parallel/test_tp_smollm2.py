"""Tensor parallelism at 3 on SmolLM2-135M (9 heads / 3 KV heads, one KV head per rank; 49,152
vocabulary rows split 3 ways): greedy tokens equal one process's, also under recompute
preemption with prefix caching. CPU, gloo, one torch thread per rank. Marked slow (two ranks
start and load the real weights)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from common.sampling_params import SamplingParams
from engine.llm import LLM

pytestmark = pytest.mark.slow
# 10 blocks of 16 tokens for 4 x (~40 + 12) tokens: the last sequences wait or are recomputed
CONFIG = {"dtype": "float32", "num_gpu_blocks": 10, "num_cpu_blocks": 0, "preemption_mode": "recompute",
          "max_num_seqs": 4, "tensor_parallel_threads": 1}
PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(smollm2_dir: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    system = "You are a helpful assistant who answers in one short sentence. "  # a shared prefix block
    texts = ["What is the capital of France?", "Name a primary colour.", "How many legs does a spider have?",
             "Write the word 'hello' backwards."]
    return [tok(system * 2 + t)["input_ids"] for t in texts]


@pytest.fixture(scope="module")
def reference(smollm2_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    with LLM(str(smollm2_dir), **CONFIG) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS)]


@pytest.fixture(scope="module")
def tp3(smollm2_dir: Path) -> Iterator[LLM]:
    with LLM(str(smollm2_dir), tensor_parallel_size=3, **CONFIG) as llm:
        yield llm


def test_greedy_tokens_at_3_ranks_equal_one_process(tp3: LLM, prompts: list[list[int]],
                                                    reference: list[list[int]]) -> None:
    got = [o.outputs[0].token_ids for o in tp3.generate(prompts, PARAMS)]
    assert got == reference
    stats = tp3.stats()
    assert stats["preemptions"].get("recompute", 0) > 0 or stats["prefix_hits"] > 0
    assert stats["prefix_hits"] > 0
