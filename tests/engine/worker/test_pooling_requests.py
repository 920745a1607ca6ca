"""A pooling request on the engine thread, as the worker drives it: the wire request's `pooling`
reaches the engine (first run and resume after a takeover), the finishing wire message carries
the vector and the finish, its checkpoint makes a resume unnecessary, and a generation request
is refused there with a message for the client."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from common.pooling_params import PoolingParams, embedding_floats
from common.protocol import EngineHeartbeat, EngineRequest, OutputMessage, Progress
from common.sampling_params import SamplingParams
from engine.config import EngineConfig
from engine.worker.engine_thread import AddJob, EngineThread
from engine.worker.tracked import Tracked, resume, to_wire
from tests.fixtures.models import make_tiny_model_dir


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineThread]:
    folder = make_tiny_model_dir(tmp_path_factory.mktemp("worker-embed"), "qwen3", seed=2, headless=True)
    engine_host = EngineThread()
    engine_host._build(EngineConfig(model=str(folder), dtype="float32", kv_cache_memory=4 << 20, device="cpu"))
    yield engine_host
    engine_host.close()


def _request(request_id: str, pooling: PoolingParams | None) -> EngineRequest:
    return EngineRequest(id=request_id, gateway="gw", model="m", prompt_token_ids=[4, 8, 15, 16, 23, 42],
                         params=SamplingParams(max_tokens=1), arrival=0.0, pooling=pooling)


def _start(request: EngineRequest) -> tuple[Tracked, AddJob]:
    started = resume(request, "1-0", Progress())
    assert started is not None
    return started


def _finish(host: EngineThread, request: EngineRequest) -> OutputMessage:
    tracked, job = _start(request)
    result = host.step([job], [])
    while not result.outputs:
        result = host.step([], [])
    [out] = result.outputs
    return to_wire(tracked, out)


def test_vector_on_the_finishing_message_and_resume(host: EngineThread) -> None:
    message = _finish(host, _request("e1", PoolingParams()))
    assert message.embedding is not None and message.error is None
    assert [(o.index, o.token_ids, o.finish_reason) for o in message.outputs] == [(0, [], "stop")]
    assert message.usage is not None and message.usage.prompt_tokens == 6
    assert len(embedding_floats(message.embedding)) == 64
    again = _finish(host, _request("e2", PoolingParams()))  # a takeover recomputes: the same bits
    assert again.embedding == message.embedding
    progress = Progress()
    progress.fold(message.checkpoint())
    assert resume(_request("e1", PoolingParams()), "1-0", progress) is None  # the client had it all
    assert host.engine.block_manager.num_used_blocks == 0


def test_generation_refused_on_a_pooling_engine(host: EngineThread) -> None:
    _, job = _start(_request("g1", None))
    result = host.step([job], [])
    assert "embeddings" in result.rejected["g1"][0]
    assert not host.engine.has_unfinished_requests()


def test_heartbeat_announces_the_runner() -> None:
    beat = EngineHeartbeat(engine_id="e", model="m", tokenizer="/tok", max_model_len=512, time=1.0,
                           runner="pooling")
    assert EngineHeartbeat.from_hash(beat.to_hash()).runner == "pooling"
    plain = EngineHeartbeat(engine_id="e", model="m", tokenizer="/tok", max_model_len=512, time=1.0).to_hash()
    assert "runner" not in plain and EngineHeartbeat.from_hash(plain).runner == "generate"
