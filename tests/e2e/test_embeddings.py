"""/v1/embeddings end to end with the official `openai` client: gateway (in-process) → real Redis →
real engine processes, a pooling engine (a headless random Qwen3, detected from its folder) and
a generating one (a tiny Llama). The vectors equal the in-process `LLM.embed` bit for bit and HF's
pooled hidden states; float and base64, token-id inputs, batch order and usage; bad requests get
OpenAI error bodies, the engines keep serving and hold no block."""

from __future__ import annotations

import base64
from array import array
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import openai
import pytest
import torch
import torch.nn.functional as F
from openai import AsyncOpenAI

from pagedserve.launch.redis_server import RedisServer
from tests.e2e.support import EngineProcess, serve_gateway, start_engines
from tests.fixtures.models import make_tiny_model_dir

EMBED, GEN = "embedder", "generator"
ENGINE_ARGS = ("--kv-cache-memory", "8MiB", "--max-num-batched-tokens", "32")
TEXTS = ["The capital of France is", "a", "Paged attention keeps the KV cache in fixed-size blocks. " * 3, "hi there"]


@pytest.fixture(scope="module")
def embedder_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("e2e-qwen3-embed"), "qwen3", seed=11, headless=True)


@pytest.fixture(scope="module")
def stack(embedder_dir: Path, tiny_llama_dir: Path,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, EngineProcess, EngineProcess]]:
    logs = tmp_path_factory.mktemp("e2e-embeddings")
    with RedisServer() as server:
        [pooling] = start_engines(embedder_dir, server.url, logs, ["embed-0"], "--served-model-name", EMBED,
                                  *ENGINE_ARGS)
        try:
            [generating] = start_engines(tiny_llama_dir, server.url, logs, ["gen-0"], "--served-model-name", GEN,
                                         *ENGINE_ARGS)
            try:
                yield server.url, pooling, generating
            finally:
                generating.stop()
        finally:
            pooling.stop()


def _client(url: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def _in_process(model_dir: Path, prompts: list[list[int]]) -> list[list[float]]:
    from engine.llm import LLM

    with LLM(str(model_dir), dtype="float32", kv_cache_memory=8 << 20, max_num_batched_tokens=32) as llm:
        return [r.outputs.embedding for r in llm.embed(prompts)]


def _token_ids(model_dir: Path, texts: list[str]) -> list[list[int]]:
    from gateway.text.tokenizer import ModelTokenizer

    tok = ModelTokenizer(str(model_dir))
    return [tok.encode(t) for t in texts]


async def test_float_and_base64_match_the_engine_and_hf(stack: tuple[str, EngineProcess, EngineProcess],
                                                        embedder_dir: Path) -> None:
    redis_url, pooling, _ = stack
    ids = _token_ids(embedder_dir, TEXTS)
    want = _in_process(embedder_dir, ids)
    async with serve_gateway(redis_url) as url, _client(url) as client:
        floats = await client.embeddings.create(model=EMBED, input=TEXTS, encoding_format="float")
        assert [d.index for d in floats.data] == [0, 1, 2, 3]
        assert [d.embedding for d in floats.data] == want  # the engine's vectors, in input order, bit for bit
        total = sum(len(i) for i in ids)
        assert floats.usage.prompt_tokens == floats.usage.total_tokens == total
        assert floats.model == EMBED
        default = await client.embeddings.create(model=EMBED, input=TEXTS)  # the client asks for base64
        assert [d.embedding for d in default.data] == want
        by_ids = await client.embeddings.create(model=EMBED, input=ids[2], encoding_format="float")
        assert by_ids.data[0].embedding == want[2]
        raw_body = {"model": EMBED, "input": [ids[1], ids[0]], "encoding_format": "base64"}
        async with aiohttp.ClientSession() as session, session.post(f"{url}/v1/embeddings", json=raw_body) as resp:
            assert resp.status == 200  # raw base64: little-endian float32
            body = await resp.json()
        raw = [array("f", base64.b64decode(d["embedding"])).tolist() for d in body["data"]]
        assert raw == [want[1], want[0]]
        models = {m.id: m for m in (await client.models.list()).data}
        assert models[EMBED].model_extra["runner"] == "pooling" and models[GEN].model_extra["runner"] == "generate"
    from transformers import AutoModel

    hf = AutoModel.from_pretrained(str(embedder_dir), dtype=torch.float32).eval()
    with torch.inference_mode():
        for prompt, vector in zip(ids, want, strict=True):
            ref = F.normalize(hf(torch.tensor([prompt])).last_hidden_state[0, -1], dim=0)
            assert F.cosine_similarity(ref, torch.tensor(vector), dim=0).item() >= 0.999
    pooling.wait_drained()


async def test_bad_requests_get_openai_errors(stack: tuple[str, EngineProcess, EngineProcess]) -> None:
    redis_url, pooling, generating = stack
    async with serve_gateway(redis_url) as url, _client(url) as client:
        bad_inputs: list[object] = [[], "", [[]], [1, "a"], [[1, 2], "x", 3], {"a": 1}, [-1], [[10**6]]]
        for bad in bad_inputs:
            with pytest.raises(openai.BadRequestError) as err:
                await client.embeddings.create(model=EMBED, input=bad)  # type: ignore[arg-type]
            assert err.value.body["param"] == "input", bad  # type: ignore[index]
        with pytest.raises(openai.BadRequestError) as err:
            await client.embeddings.create(model=EMBED, input=[[5] * 600])
        assert err.value.code == "context_length_exceeded"
        with pytest.raises(openai.BadRequestError, match="matryoshka"):  # refused by the engine
            await client.embeddings.create(model=EMBED, input="hello", dimensions=16)
        with pytest.raises(openai.BadRequestError, match="encoding_format"):
            await client.embeddings.create(model=EMBED, input="hello", encoding_format="int8")  # type: ignore[arg-type]
        with pytest.raises(openai.BadRequestError, match="generation, not embeddings"):
            await client.embeddings.create(model=GEN, input="hello")
        with pytest.raises(openai.BadRequestError, match="served for embeddings"):
            await client.completions.create(model=EMBED, prompt="hello", max_tokens=2)
        with pytest.raises(openai.NotFoundError):
            await client.embeddings.create(model="nope", input="hello")
        ok = await client.embeddings.create(model=EMBED, input=["still serving"], encoding_format="float")
        assert len(ok.data[0].embedding) == 64
        gen = await client.completions.create(model=GEN, prompt="still", max_tokens=3, temperature=0)
        assert gen.usage is not None and gen.usage.completion_tokens >= 1
    assert pooling.wait_drained()["num_used_blocks"] == 0
    generating.wait_drained()


async def test_batch_of_mixed_lengths_gives_each_input_its_own_vector(
        stack: tuple[str, EngineProcess, EngineProcess]) -> None:
    redis_url, pooling, _ = stack
    target = list(range(60, 150))
    others = [[7] * n for n in (3, 41, 1, 77, 12)]
    async with serve_gateway(redis_url) as url, _client(url) as client:
        alone = await client.embeddings.create(model=EMBED, input=[target], encoding_format="float")
        mixed = await client.embeddings.create(model=EMBED, input=[*others[:2], target, *others[2:]],
                                               encoding_format="float")
    assert mixed.data[2].embedding == alone.data[0].embedding
    assert len({tuple(d.embedding) for d in mixed.data}) == len(mixed.data)
    pooling.wait_drained()
