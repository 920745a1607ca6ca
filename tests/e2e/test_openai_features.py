"""The OpenAI features end to end with the official `openai` client: a real engine process (tiny random
Llama, fp32, chunked prefill forced by a 32-token budget), an in-process gateway, real Redis.

JSON-schema answers parse and validate for sampled outputs over several seeds; required and
named tool calls come back valid, whole and streamed; penalties change greedy output; a -100
bias bans the greedy token; /tokenize equals the Hugging Face tokenizer; echoed prompt logprobs
equal HF's log-softmax (also on a prefix-cache hit); a chunk-stripping SSE client loses nothing
in a burst where first tokens wait."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import jsonschema
import pytest
from openai import AsyncOpenAI

from pagedserve.launch.redis_server import RedisServer
from tests.e2e.support import EngineProcess, serve_gateway, start_engines
from tests.fixtures.gateway import parse_sse
from tests.fixtures.models import make_tiny_model_dir
from tests.fixtures.sse_clients import StrippingSSEReader

MODEL = "tiny"
SEEDS = range(4)
PERSON = {"type": "object", "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "pet": {"enum": ["cat", "dog", "fish"]}},
          "required": ["name", "age", "pet"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS: list[Any] = [{"type": "function", "function": {"name": "add", "parameters": ADD}},
                    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
SCHEMAS = {"add": ADD, "get_weather": WEATHER}
MSG: list[Any] = [{"role": "user", "content": "Describe a person as JSON."}]
PROMPT_IDS = [(i * 37 + 11) % 250 for i in range(40)]  # > 2 blocks, > one 32-token prefill chunk


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Llama with a 4096-token context: the fallback tool prompt is ~1000 byte tokens."""
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-long"), max_position_embeddings=4096)


@pytest.fixture(scope="module")
def stack(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, EngineProcess]]:
    with RedisServer() as server:
        [engine] = start_engines(model_dir, server.url, tmp_path_factory.mktemp("e2e-features"), ["feat-0"],
                                 "--served-model-name", MODEL, "--kv-cache-memory", "8MiB",
                                 "--max-num-batched-tokens", "32")
        try:
            yield server.url, engine
        finally:
            engine.stop()


def _client(url: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


async def _stream_text(stream: Any) -> tuple[str, str | None]:
    text, reason = "", None
    async for chunk in stream:
        for choice in chunk.choices:
            text += getattr(choice, "text", None) or (choice.delta.content if hasattr(choice, "delta") else "") or ""
            reason = choice.finish_reason or reason
    return text, reason


async def test_json_schema_answers_validate(stack: tuple[str, EngineProcess]) -> None:
    redis_url, engine = stack
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    async with serve_gateway(redis_url) as url, _client(url) as client:
        for seed in SEEDS:
            chat = await client.chat.completions.create(model=MODEL, messages=MSG, response_format=fmt, seed=seed,
                                                        temperature=1.0, max_tokens=200)
            jsonschema.validate(json.loads(chat.choices[0].message.content or ""), PERSON)
            assert chat.choices[0].finish_reason == "stop"
            stream = await client.chat.completions.create(model=MODEL, messages=MSG, response_format=fmt,
                                                          seed=seed, temperature=1.0, max_tokens=200, stream=True)
            text, reason = await _stream_text(stream)
            jsonschema.validate(json.loads(text), PERSON)
            assert reason == "stop"
            comp = await client.completions.create(model=MODEL, prompt="Person:", seed=seed, temperature=1.0,
                                                   max_tokens=200, extra_body={"response_format": fmt})
            jsonschema.validate(json.loads(comp.choices[0].text), PERSON)
        obj = await client.chat.completions.create(model=MODEL, messages=MSG, temperature=1.0, seed=9,
                                                   max_tokens=300, response_format={"type": "json_object"})
        assert isinstance(json.loads(obj.choices[0].message.content or ""), dict)
        choice = await client.completions.create(model=MODEL, prompt="Pick:", max_tokens=20, temperature=1.0,
                                                 seed=1, extra_body={"guided_choice": ["alpha", "beta"]})
        assert choice.choices[0].text in ("alpha", "beta")
    engine.wait_drained()


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
async def test_tool_calls_are_valid(stack: tuple[str, EngineProcess], tool_choice: Any) -> None:
    """One call per answer (parallel_tool_calls false): the grammar ends after the call, so the
    answer must finish with `tool_calls`, whole and streamed, whatever the random model samples."""
    redis_url, engine = stack
    names = {"add", "get_weather"} if tool_choice == "required" else {"get_weather"}
    ask: Any = [{"role": "user", "content": "What is the weather in Oslo for 3 days?"}]
    args: dict[str, Any] = {"model": MODEL, "messages": ask, "tools": TOOLS, "tool_choice": tool_choice,
                            "temperature": 1.0, "max_tokens": 300, "parallel_tool_calls": False}
    async with serve_gateway(redis_url) as url, _client(url) as client:
        for seed in SEEDS:
            reply = await client.chat.completions.create(seed=seed, **args)
            choice = reply.choices[0]
            assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
            assert len(choice.message.tool_calls) == 1
            _check_calls([(c.function.name, c.function.arguments) for c in choice.message.tool_calls], names)  # type: ignore[union-attr]
            stream = await client.chat.completions.create(seed=seed, stream=True, **args)
            calls: dict[int, dict[str, str]] = {}
            reason = None
            async for chunk in stream:
                for c in chunk.choices:
                    reason = c.finish_reason or reason
                    for tc in c.delta.tool_calls or []:
                        entry = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                        entry["name"] += (tc.function.name if tc.function else None) or ""
                        entry["arguments"] += (tc.function.arguments if tc.function else None) or ""
            assert reason == "tool_calls" and len(calls) == 1
            _check_calls([(e["name"], e["arguments"]) for e in calls.values()], names)
    engine.wait_drained()


async def test_parallel_tool_calls_are_each_valid(stack: tuple[str, EngineProcess]) -> None:
    """With parallel calls the grammar allows another call after each one, so a random model may
    run to max_tokens: every call it completed is still a valid call, and a cut-off one is not
    reported as a call."""
    redis_url, engine = stack
    ask: Any = [{"role": "user", "content": "Add 2 and 3, and get the weather in Lima."}]
    async with serve_gateway(redis_url) as url, _client(url) as client:
        for seed in SEEDS:
            reply = await client.chat.completions.create(model=MODEL, messages=ask, tools=TOOLS, seed=seed,
                                                         tool_choice="required", temperature=1.0, max_tokens=300)
            choice = reply.choices[0]
            assert choice.finish_reason in ("tool_calls", "length") and choice.message.tool_calls
            _check_calls([(c.function.name, c.function.arguments) for c in choice.message.tool_calls],  # type: ignore[union-attr]
                         {"add", "get_weather"})
    engine.wait_drained()


def _check_calls(calls: list[tuple[str, str]], names: set[str]) -> None:
    for name, arguments in calls:
        assert name in names
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


async def _greedy_ids(client: AsyncOpenAI, **extra: Any) -> list[int]:
    comp = await client.completions.create(model=MODEL, prompt="ab ab ab ab ab ab ab ab", max_tokens=24,
                                           temperature=0, logprobs=0,
                                           extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True,
                                                       **extra.pop("extra_body", {})}, **extra)
    tokens = comp.choices[0].logprobs.tokens  # type: ignore[union-attr]
    return [int(t.removeprefix("token_id:")) for t in tokens or []]


async def test_penalties_and_logit_bias(stack: tuple[str, EngineProcess]) -> None:
    redis_url, engine = stack
    async with serve_gateway(redis_url) as url, _client(url) as client:
        base = await _greedy_ids(client)
        assert len(base) == 24 and await _greedy_ids(client) == base
        for extra in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0},
                      {"extra_body": {"repetition_penalty": 2.0}}):
            changed = await _greedy_ids(client, **extra)
            assert changed != base, extra
            assert await _greedy_ids(client, **extra) == changed  # deterministic
        banned = base[0]
        biased = await _greedy_ids(client, logit_bias={str(banned): -100})
        assert banned not in biased
        favoured = await _greedy_ids(client, logit_bias={"7": 100})
        assert favoured == [7] * 24
    engine.wait_drained()


def _hf_prompt_logprobs(model_dir: Path, ids: list[int]) -> list[float]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return [float(logprobs[i - 1, ids[i]]) for i in range(1, len(ids))]


async def test_echoed_prompt_logprobs_equal_hf(stack: tuple[str, EngineProcess], model_dir: Path) -> None:
    redis_url, engine = stack
    expected = _hf_prompt_logprobs(model_dir, PROMPT_IDS)
    async with serve_gateway(redis_url) as url, _client(url) as client:
        cached = []
        for _ in range(2):  # the second run hits the prefix cache: its logprobs must still be there
            comp = await client.completions.create(model=MODEL, prompt=PROMPT_IDS, echo=True, logprobs=1,
                                                   max_tokens=1, temperature=0,
                                                   extra_body={"return_tokens_as_token_ids": True})
            lp = comp.choices[0].logprobs
            assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
            assert lp.tokens[:len(PROMPT_IDS)] == [f"token_id:{t}" for t in PROMPT_IDS]
            assert lp.token_logprobs[0] is None
            got = lp.token_logprobs[1:len(PROMPT_IDS)]
            assert max(abs(g - e) for g, e in zip(got, expected, strict=True)) < 2e-3  # type: ignore[operator]
            cached.append(comp.usage.prompt_tokens_details.cached_tokens)  # type: ignore[union-attr]
        assert cached[1] >= 32
        raw = await client.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=1, temperature=0,
                                              extra_body={"prompt_logprobs": 0})
        plp = raw.model_extra["prompt_logprobs"]  # type: ignore[index]
        assert plp[0] is None
        got = [plp[i][str(t)]["logprob"] for i, t in enumerate(PROMPT_IDS) if i]
        assert max(abs(g - e) for g, e in zip(got, expected, strict=True)) < 2e-3
    engine.wait_drained()


async def test_tokenize_equals_hf_tokenizer(stack: tuple[str, EngineProcess], model_dir: Path) -> None:
    from transformers import AutoTokenizer

    redis_url, _ = stack
    hf = AutoTokenizer.from_pretrained(str(model_dir))
    text = "Paged attention, 你好 😀!"
    messages = [{"role": "user", "content": text}]
    async with serve_gateway(redis_url) as url, aiohttp.ClientSession() as session:
        async with session.post(f"{url}/tokenize", json={"model": MODEL, "prompt": text}) as resp:
            body = await resp.json()
        assert body["tokens"] == hf(text)["input_ids"] and body["max_model_len"] == 4096
        async with session.post(f"{url}/tokenize", json={"model": MODEL, "messages": messages}) as resp:
            chat = await resp.json()
        assert chat["tokens"] == list(hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                             return_dict=False))
        async with session.post(f"{url}/detokenize", json={"model": MODEL, "tokens": body["tokens"]}) as resp:
            assert (await resp.json())["prompt"] == hf.decode(body["tokens"], skip_special_tokens=True)


async def test_stripping_sse_client_in_a_burst(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """One sequence at a time and 6 streams at once: the last waits for 5 others to finish (1,000
    decode steps), many idle ticks of its handler. A client that strips each chunk (vLLM's benchmark) must still see
    every event: what it reassembles equals what a correct SSE parser reads from the same bytes."""
    with RedisServer() as server:
        [engine] = start_engines(tiny_llama_dir, server.url, tmp_path, ["burst-0"], "--served-model-name", MODEL,
                                 "--max-num-seqs", "1")
        try:
            async with serve_gateway(server.url, sse_ping_s=0.05) as url, aiohttp.ClientSession() as session:
                async def run(i: int) -> tuple[StrippingSSEReader, bytes, float]:
                    body = {"model": MODEL, "prompt": f"request {i}:", "max_tokens": 200, "temperature": 0,
                            "ignore_eos": True, "stream": True}
                    start, first, raw = time.monotonic(), 0.0, b""
                    reader = StrippingSSEReader()
                    async with session.post(f"{url}/v1/completions", json=body) as resp:
                        assert resp.status == 200
                        async for chunk in resp.content.iter_any():
                            first = first or time.monotonic() - start
                            raw += chunk
                            reader.feed(chunk)
                    return reader, raw, first

                results = await asyncio.gather(*(run(i) for i in range(6)))
            for reader, raw, _ in results:
                events = parse_sse(raw.decode())
                assert reader.done and reader.events == events
                assert len([e for e in events if e != "[DONE]"]) >= 2
            waits = sorted(first for _, _, first in results)
            assert waits[-1] > 0.25, waits  # the last first token waited through 5+ idle ticks of 0.05 s
            engine.wait_drained()
        finally:
            engine.stop()
