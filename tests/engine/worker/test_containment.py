"""Containment on the engine thread: a step that raises fails the requests it ran (their
blocks return to the pool) and the engine goes on serving; requests that were only waiting
survive. The fault is injected into the real model runner of a tiny model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from common.sampling_params import SamplingParams
from engine.config import EngineConfig
from engine.worker.engine_thread import AddJob, EngineThread

PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture
def host(tiny_llama_dir: Path) -> Iterator[EngineThread]:
    engine_host = EngineThread()
    engine_host._build(EngineConfig(model=str(tiny_llama_dir), kv_cache_memory=4 << 20, device="cpu",
                                    max_num_seqs=2))
    yield engine_host
    engine_host.close()


def _poison(host: EngineThread, request_id: str) -> None:
    """Make the model runner raise whenever `request_id` is in the batch (a stand-in for a
    kernel or sampler bug that only one request's shape triggers)."""
    runner = host.engine.runner
    execute = runner.execute

    def failing(sched: Any, *args: Any, **kwargs: Any) -> Any:
        if any(item.seq.request.request_id == request_id for item in sched.scheduled):
            raise IndexError("injected fault")
        return execute(sched, *args, **kwargs)

    runner.execute = failing


def _finish(host: EngineThread, jobs: list[AddJob]) -> tuple[dict[str, list[int]], dict[str, str]]:
    tokens: dict[str, list[int]] = {}
    failed: dict[str, str] = {}
    result = host.step(jobs, [])
    while True:
        failed.update(result.failed)
        for out in result.outputs:
            tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
        if not host.engine.has_unfinished_requests():
            return tokens, failed
        result = host.step([], [])


def test_a_failing_step_fails_only_its_requests(host: EngineThread) -> None:
    clean, _ = _finish(host, [AddJob(request_id="clean", prompt_token_ids=[5, 6, 7], params=PARAMS)])
    _poison(host, "bad")
    jobs = [AddJob(request_id="bad", prompt_token_ids=[1, 2, 3], params=PARAMS),
            AddJob(request_id="mate", prompt_token_ids=[9, 8, 7], params=PARAMS),
            AddJob(request_id="later", prompt_token_ids=[5, 6, 7], params=PARAMS)]
    tokens, failed = _finish(host, jobs)
    # max_num_seqs=2: "bad" and "mate" ran in the failing step, "later" was still waiting
    assert set(failed) == {"bad", "mate"} and "injected fault" in failed["bad"]
    assert tokens["later"] == clean["clean"]  # the engine kept serving, with the same answer
    assert host.engine.block_manager.num_used_blocks == 0
    again, failed = _finish(host, [AddJob(request_id="after", prompt_token_ids=[5, 6, 7], params=PARAMS)])
    assert not failed and again["after"] == clean["clean"]
