"""LoRA adapters on a tensor-parallel engine through the whole stack, real processes: one Redis,
one `pagedserve engine --tensor-parallel-size 2` (rank 1 spawned) serving an adapter from
start-up, an in-process gateway. The base model and the adapter answer the in-process engine's
greedy text; an adapter loaded at run time over HTTP (`/v1/load_lora_adapter`: through Redis to
rank 0, whose placement carries it to rank 1) answers its own, beside the others; bad adapters
get the 400s one process gives, and the engine goes on serving."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from pagedserve.launch.redis_server import RedisServer
from tests.e2e.lora_support import MAX_TOKENS, MODEL, PROMPTS, expected_texts, openai_client, post
from tests.e2e.support import EngineProcess, serve_gateway, start_engines
from tests.engine.lora.adapters import make_adapter


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("e2e-lora-tp-adapters")
    return {"a0": make_adapter(tiny_llama_dir, root / "a0", seed=31, r=6),
            "dyn": make_adapter(tiny_llama_dir, root / "dyn", seed=78, r=8),
            "wide": make_adapter(tiny_llama_dir, root / "wide", seed=79, r=16)}  # above --max-lora-rank


@pytest.fixture(scope="module")
def stack(tiny_llama_dir: Path, adapters: dict[str, Path],
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, EngineProcess]]:
    with RedisServer() as server:
        [engine] = start_engines(tiny_llama_dir, server.url, tmp_path_factory.mktemp("e2e-lora-tp"), ["lora-tp-0"],
                                 "--served-model-name", MODEL, "--kv-cache-memory", "4MiB",
                                 "--tensor-parallel-size", "2", "--tensor-parallel-threads", "1", "--enable-lora",
                                 "--max-loras", "2", "--max-lora-rank", "8", "--lora-modules", f"a0={adapters['a0']}")
        try:
            yield server.url, engine
        finally:
            engine.stop()


async def test_adapters_on_a_tensor_parallel_engine(stack: tuple[str, EngineProcess], tiny_llama_dir: Path,
                                                    adapters: dict[str, Path], tmp_path: Path) -> None:
    redis_url, engine = stack
    names = (MODEL, "a0", "dyn")
    expected = expected_texts(tiny_llama_dir, adapters, names)
    assert len({expected[(name, PROMPTS[0])] for name in names}) == 3  # each adapter answers its own
    async with serve_gateway(redis_url) as url, openai_client(url) as client, aiohttp.ClientSession() as session:

        async def answers(keys: list[tuple[str, str]]) -> list[str]:
            async def complete(name: str, prompt: str) -> str:
                out = await client.completions.create(model=name, prompt=prompt, max_tokens=MAX_TOKENS,
                                                      temperature=0, extra_body={"ignore_eos": True})
                return out.choices[0].text

            return list(await asyncio.gather(*(complete(name, prompt) for name, prompt in keys)))

        keys = [(name, prompt) for prompt in PROMPTS for name in (MODEL, "a0")]
        assert await answers(keys) == [expected[key] for key in keys]

        status, text = await post(session, url, "load_lora_adapter", {"lora_name": "dyn",
                                                                      "lora_path": str(adapters["dyn"])})
        assert (status, text) == (200, "Success: LoRA adapter 'dyn' added successfully.")
        keys = [(name, prompt) for prompt in PROMPTS for name in ("dyn", "a0", MODEL)]
        assert await answers(keys) == [expected[key] for key in keys]

        status, error = await post(session, url, "load_lora_adapter", {"lora_name": "wide",
                                                                       "lora_path": str(adapters["wide"])})
        assert (status, error["code"]) == (400, "lora_invalid") and "exceeds --max-lora-rank 8" in error["message"]
        status, error = await post(session, url, "load_lora_adapter",
                                   {"lora_name": "bad", "lora_path": str(tmp_path / "nowhere")})
        assert (status, error["code"]) == (400, "lora_invalid") and "does not exist" in error["message"]

        status, text = await post(session, url, "unload_lora_adapter", {"lora_name": "dyn"})
        assert (status, text) == (200, "Success: LoRA adapter 'dyn' removed successfully.")
        keys = [(name, PROMPTS[1]) for name in (MODEL, "a0")]
        assert await answers(keys) == [expected[key] for key in keys]
    engine.wait_drained()
