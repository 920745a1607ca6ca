"""Tensor parallelism at 2 on the CPU (gloo, spawned rank 1) gives the tokens of one process:
greedy, under swap preemption (swap pairs broadcast), with prefix caching, and seeded parallel
sampling (copy-on-write pairs); then a hung rank fails the group within its collective timeout.

One group serves the module (starting ranks costs seconds); the hang test breaks it, so it runs last."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from common.sampling_params import SamplingParams
from engine.llm import LLM
from engine.parallel import TensorParallelError

TIMEOUT_S = 5.0
# a pool small enough that the preemption test swaps (26 blocks of 16 tokens for 8 x 100 tokens)
CONFIG = {"dtype": "float32", "num_gpu_blocks": 26, "num_cpu_blocks": 64, "preemption_mode": "swap",
          "max_num_seqs": 8, "tensor_parallel_threads": 1}


@pytest.fixture(scope="module")
def single(tiny_llama_dir: Path) -> Iterator[LLM]:
    with LLM(str(tiny_llama_dir), **CONFIG) as llm:
        yield llm


@pytest.fixture(scope="module")
def tp2(tiny_llama_dir: Path) -> Iterator[LLM]:
    with LLM(str(tiny_llama_dir), tensor_parallel_size=2, tensor_parallel_timeout=TIMEOUT_S, **CONFIG) as llm:
        yield llm


def _tokens(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[list[int]]]:
    return [[c.token_ids for c in out.outputs] for out in llm.generate(prompts, params)]


GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def test_greedy_tokens_equal_one_process(single: LLM, tp2: LLM) -> None:
    prompts = [[1, 2, 3, 4, 5], list(range(30, 70)), [7] * 17, list(range(200, 203))]
    assert _tokens(tp2, prompts, GREEDY) == _tokens(single, prompts, GREEDY)
    assert tp2.stats()["tensor_parallel_size"] == 2
    assert tp2.engine.block_manager.num_blocks == single.engine.block_manager.num_blocks == 26


def test_greedy_under_swap_preemption(single: LLM, tp2: LLM) -> None:
    prompts = [[(i * 37 + j) % 250 for j in range(40 + i)] for i in range(8)]
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    before = tp2.stats()["preemptions"].get("swap", 0)
    assert _tokens(tp2, prompts, params) == _tokens(single, prompts, params)
    assert tp2.stats()["preemptions"].get("swap", 0) > before  # blocks went to host and back on both ranks
    assert tp2.stats()["swapped_in_blocks"] > 0


def test_greedy_with_prefix_caching(single: LLM, tp2: LLM) -> None:
    prefix = list(range(100, 148))  # three full blocks shared by every prompt
    prompts = [[*prefix, i, i + 1, i + 2] for i in range(4)]
    hits = tp2.stats()["prefix_hits"]
    first = _tokens(tp2, prompts[:1], GREEDY)
    rest = _tokens(tp2, prompts[1:], GREEDY)
    assert tp2.stats()["prefix_hits"] > hits
    assert first + rest == _tokens(single, prompts[:1], GREEDY) + _tokens(single, prompts[1:], GREEDY)


def test_seeded_parallel_sampling_copies_blocks_on_write(single: LLM, tp2: LLM) -> None:
    params = SamplingParams(n=3, max_tokens=20, temperature=0.9, seed=7, ignore_eos=True)
    prompts = [list(range(10, 45))]  # a partial last block: the forks copy it on write
    cow = tp2.stats()["cow_copies"]
    assert _tokens(tp2, prompts, params) == _tokens(single, prompts, params)
    assert tp2.stats()["cow_copies"] > cow


def test_a_hung_rank_fails_the_group_within_the_timeout(tp2: LLM) -> None:
    parallel = tp2.engine.parallel
    assert parallel is not None
    (rank1,) = parallel.pids()
    os.kill(rank1, signal.SIGSTOP)
    start = time.monotonic()
    try:
        with pytest.raises(TensorParallelError, match="tensor-parallel group failed"):
            tp2.generate([[1, 2, 3]], GREEDY)
    finally:
        elapsed = time.monotonic() - start
        with contextlib.suppress(ProcessLookupError):  # the group killed it
            os.kill(rank1, signal.SIGCONT)
    assert elapsed < TIMEOUT_S + 10, elapsed
    assert not parallel.procs[0].is_alive()  # the group killed the hung rank
    with pytest.raises(TensorParallelError):
        tp2.generate([[4, 5]], GREEDY)  # and refuses further steps
