"""LoRA adapters through the whole stack, real processes: one Redis, one engine serving a tiny
model with three adapters (`--lora-modules` in both forms), an in-process gateway, the `openai`
client. `/v1/models` lists each adapter with its base as `parent`; a request picks its adapter by
`model`, and concurrent requests of the base and of every adapter each get the in-process engine's
greedy answer for that adapter; an unknown model is a 404. Adapters loaded and unloaded at run
time over HTTP (`/v1/load_lora_adapter`, `/v1/unload_lora_adapter`) reach the engine through Redis;
`/v1/responses` by adapter name runs that adapter."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import openai
import pytest

from pagedserve.launch.redis_server import RedisServer
from tests.e2e.lora_support import MAX_TOKENS, MODEL, PROMPTS, expected_texts, openai_client, post
from tests.e2e.support import EngineProcess, serve_gateway, start_engines
from tests.engine.lora.adapters import make_adapter

ADAPTERS = ("a0", "a1", "a2")


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("e2e-lora-adapters")
    return {name: make_adapter(tiny_llama_dir, root / name, seed=30 + i, r=4 + 2 * i)
            for i, name in enumerate(ADAPTERS)}


@pytest.fixture(scope="module")
def stack(tiny_llama_dir: Path, adapters: dict[str, Path],
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, EngineProcess]]:
    modules = [f"a0={adapters['a0']}", f"a1={adapters['a1']}",
               json.dumps({"name": "a2", "path": str(adapters["a2"]), "base_model_name": MODEL})]
    with RedisServer() as server:
        [engine] = start_engines(tiny_llama_dir, server.url, tmp_path_factory.mktemp("e2e-lora"), ["lora-0"],
                                 "--served-model-name", MODEL, "--kv-cache-memory", "4MiB", "--enable-lora",
                                 "--max-loras", "2", "--max-lora-rank", "8", "--lora-modules", *modules)
        try:
            yield server.url, engine
        finally:
            engine.stop()


async def test_adapters_by_model_name(stack: tuple[str, EngineProcess], tiny_llama_dir: Path,
                                      adapters: dict[str, Path]) -> None:
    redis_url, engine = stack
    expected = expected_texts(tiny_llama_dir, adapters, (MODEL, *ADAPTERS))
    assert len({expected[(name, PROMPTS[0])] for name in (MODEL, *ADAPTERS)}) == 4  # each adapter answers its own
    async with serve_gateway(redis_url) as url, openai_client(url) as client:
        models = {m.id: m for m in (await client.models.list()).data}
        assert sorted(models) == sorted([MODEL, *ADAPTERS])
        assert (models[MODEL].model_extra or {}).get("parent", "absent") is None
        assert all((models[a].model_extra or {}).get("parent") == MODEL for a in ADAPTERS)

        async def complete(name: str, prompt: str) -> tuple[str, str]:
            out = await client.completions.create(model=name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                                  extra_body={"ignore_eos": True})
            return out.model, out.choices[0].text

        keys = [(name, prompt) for prompt in PROMPTS for name in (MODEL, *ADAPTERS)]
        answers = await asyncio.gather(*(complete(name, prompt) for name, prompt in keys))
        for key, (model, text) in zip(keys, answers, strict=True):
            assert model == key[0]
            assert text == expected[key], key
        with pytest.raises(openai.NotFoundError):
            await client.completions.create(model="a9", prompt="x", max_tokens=2)
    engine.wait_drained()


async def test_load_and_unload_at_run_time(stack: tuple[str, EngineProcess], tiny_llama_dir: Path,
                                           tmp_path: Path) -> None:
    redis_url, engine = stack
    dyn = make_adapter(tiny_llama_dir, tmp_path / "dyn", seed=77, r=8)
    expected = expected_texts(tiny_llama_dir, {"dyn": dyn}, ("dyn",))
    async with serve_gateway(redis_url) as url, openai_client(url) as client, aiohttp.ClientSession() as session:
        status, text = await post(session, url, "load_lora_adapter", {"lora_name": "dyn", "lora_path": str(dyn)})
        assert (status, text) == (200, "Success: LoRA adapter 'dyn' added successfully.")
        models = {m.id: m for m in (await client.models.list()).data}
        assert models["dyn"].model_extra is not None and models["dyn"].model_extra["parent"] == MODEL
        out = await client.completions.create(model="dyn", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
                                              extra_body={"ignore_eos": True})
        assert out.choices[0].text == expected[("dyn", PROMPTS[0])]

        status, error = await post(session, url, "load_lora_adapter", {"lora_name": "dyn", "lora_path": str(dyn)})
        assert (status, error["code"]) == (400, "lora_already_loaded")
        status, error = await post(session, url, "load_lora_adapter",
                                    {"lora_name": "bad", "lora_path": str(tmp_path / "nowhere")})
        assert (status, error["code"]) == (400, "lora_invalid") and "does not exist" in error["message"]
        status, error = await post(session, url, "load_lora_adapter", {"lora_name": "x"})
        assert (status, error["param"]) == (400, "lora_path")
        status, error = await post(session, url, "unload_lora_adapter", {"lora_name": "a0"})
        assert (status, error["code"]) == (400, "lora_static")

        status, text = await post(session, url, "unload_lora_adapter", {"lora_name": "dyn"})
        assert (status, text) == (200, "Success: LoRA adapter 'dyn' removed successfully.")
        assert "dyn" not in {m.id for m in (await client.models.list()).data}
        with pytest.raises(openai.NotFoundError):
            await client.completions.create(model="dyn", prompt="x", max_tokens=2)
        status, error = await post(session, url, "unload_lora_adapter", {"lora_name": "dyn"})
        assert (status, error["code"]) == (404, "lora_not_found")
    engine.wait_drained()


async def test_responses_route_runs_the_adapter(stack: tuple[str, EngineProcess]) -> None:
    """/v1/responses goes through the same generation path: by adapter name it answers what chat
    completions answers for that adapter (greedy, one user message), not the base model's text."""
    redis_url, engine = stack
    async with serve_gateway(redis_url) as url, openai_client(url) as client:
        texts: dict[str, tuple[str, str]] = {}
        for name in (MODEL, "a1"):
            resp = await client.responses.create(model=name, input=PROMPTS[1], max_output_tokens=MAX_TOKENS,
                                                 temperature=0, extra_body={"ignore_eos": True})
            chat = await client.chat.completions.create(model=name, messages=[{"role": "user", "content": PROMPTS[1]}],
                                                        max_tokens=MAX_TOKENS, temperature=0,
                                                        extra_body={"ignore_eos": True})
            assert resp.model == chat.model == name
            texts[name] = (resp.output_text, chat.choices[0].message.content or "")
        assert texts["a1"][0] == texts["a1"][1] and texts[MODEL][0] == texts[MODEL][1]
        assert texts["a1"][0] != texts[MODEL][0]
    engine.wait_drained()
