"""Resuming a request from its checkpoint on the engine thread continues exactly where the
dead engine stopped: same tokens for greedy and for seeded (and unseeded) sampling."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from common.protocol import EngineRequest, Progress
from common.sampling_params import SamplingParams
from engine.config import EngineConfig
from engine.worker.engine_thread import AddJob, EngineThread
from engine.worker.tracked import Tracked, resume, to_wire


@pytest.fixture(scope="module")
def host(tiny_llama_dir: Path) -> Iterator[EngineThread]:
    engine_host = EngineThread()
    engine_host._build(EngineConfig(model=str(tiny_llama_dir), dtype="float32", kv_cache_memory=4 << 20, device="cpu"))
    yield engine_host
    engine_host.close()


def _run(host: EngineThread, job: AddJob) -> list[int]:
    """Tokens the request produces after `job.generated`, stepping on this thread."""
    tokens: list[int] = []
    result = host.step([job], [])
    while True:
        for out in result.outputs:
            tokens += out.outputs[0].token_ids
        if not host.engine.has_unfinished_requests():
            return tokens
        result = host.step([], [])


@pytest.mark.parametrize("raw", [
    {"temperature": 0.0, "max_tokens": 24, "ignore_eos": True},
    {"temperature": 1.0, "seed": 11, "max_tokens": 24, "ignore_eos": True},
    {"temperature": 1.0, "max_tokens": 24, "ignore_eos": True},  # unseeded: seed derived from the id
])
def test_resume_continues_the_same_tokens(host: EngineThread, raw: dict[str, Any]) -> None:
    params = SamplingParams.from_dict(raw)
    prompt = [5, 80, 17, 33, 101, 7]
    full = _run(host, AddJob(request_id="req-a", prompt_token_ids=prompt, params=params))
    assert len(full) == 24
    resumed = _run(host, AddJob(request_id="req-a", prompt_token_ids=prompt, params=params, generated=full[:9]))
    assert full[:9] + resumed == full
    assert host.engine.block_manager.num_used_blocks == 0


def test_resume_bookkeeping_from_progress() -> None:
    request = EngineRequest(id="r1", gateway="gw", model="tiny", prompt_token_ids=[1, 2, 3],
                            params=SamplingParams(n=1, max_tokens=8), arrival=0.0)
    tracked, job = resume(request, "1-0", Progress(last_seq=4, token_ids={0: [9, 9, 9]}))  # type: ignore[misc]
    assert (tracked.seq, tracked.sent, job.generated, tracked.resumed) == (5, {0: 3}, [9, 9, 9], True)
    assert resume(request, "1-0", Progress(last_seq=6, token_ids={0: [9]}, finished={0: "stop"})) is None
    several = EngineRequest(id="r2", gateway="gw", model="tiny", prompt_token_ids=[1],
                            params=SamplingParams(n=2, max_tokens=8), arrival=0.0)
    tracked2, job2 = resume(several, "2-0", Progress(last_seq=1, token_ids={0: [4], 1: [5]}))  # type: ignore[misc]
    assert (tracked2.seq, tracked2.sent, job2.generated) == (2, {}, [])  # restarts; gateway de-dups


def test_to_wire_numbers_messages_and_offsets(host: EngineThread) -> None:
    params = SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.0)
    tracked = Tracked(EngineRequest(id="req-w", gateway="gw", model="tiny", prompt_token_ids=[4, 5, 6], params=params,
                                    arrival=0.0), "1-0")
    messages = []
    result = host.step([AddJob(request_id="req-w", prompt_token_ids=[4, 5, 6], params=tracked.request.params)], [])
    while result.outputs or host.engine.has_unfinished_requests():
        messages += [to_wire(tracked, out) for out in result.outputs]
        result = host.step([], [])
    assert [m.seq for m in messages] == list(range(len(messages)))
    assert [m.outputs[0].offset for m in messages] == [0, 1, 2]
    assert messages[-1].usage is not None and messages[-1].usage.completion_tokens == 3
    assert messages[-1].outputs[0].finish_reason == "length"
