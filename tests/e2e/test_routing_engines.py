"""Cache-aware routing to engines of other shapes (issue 40), real processes: a tensor-parallel
engine beside a single-process one, and two engines decoding speculatively. Their heartbeats
announce their prefix caches like any engine's, so a multi-turn chat's later turns find their
resent history cached and both engines serve routed requests."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from pagedserve.launch.redis_server import RedisServer
from tests.e2e.routing_support import assert_turns_follow_their_prefix
from tests.e2e.support import EngineProcess, start_engines

MODEL = "tiny"
COMMON = ("--served-model-name", MODEL, "--kv-cache-memory", "8MiB")
NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})
SHAPES = {
    "tensor_parallel": [("--tensor-parallel-size", "2", "--tensor-parallel-threads", "1"), ()],
    "speculative": [("--speculative-config", NGRAM), ("--speculative-config", NGRAM)],
}


@pytest.fixture(params=sorted(SHAPES))
def fleet(request: pytest.FixtureRequest, tiny_llama_dir: Path,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, list[EngineProcess]]]:
    logs = tmp_path_factory.mktemp(f"routing-{request.param}")
    with RedisServer() as server:
        engines: list[EngineProcess] = []
        try:
            for k, extra in enumerate(SHAPES[request.param]):
                engines += start_engines(tiny_llama_dir, server.url, logs, [f"{request.param}-{k}"], *COMMON, *extra)
            yield server.url, engines
        finally:
            for engine in engines:
                engine.stop()


async def test_multi_turn_routing_with_tensor_parallel_and_speculative_engines(
        fleet: tuple[str, list[EngineProcess]]) -> None:
    url, engines = fleet
    await assert_turns_follow_their_prefix(url, engines, MODEL)
