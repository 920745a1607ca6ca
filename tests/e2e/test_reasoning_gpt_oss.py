"""gpt-oss's harmony format end to end: a real engine serving a random-architecture gpt-oss
(attention sinks, MoE) whose weights make greedy decoding write a harmony answer — an ``analysis``
message, then a ``final`` one ended by ``<|return|>`` (tests/fixtures/scripted_model.py) — with the
harmony markers as special tokens, a real gateway process, real Redis. The gateway picks the
``gpt_oss`` parser from the chat template (no flag), renders the prompt through it
(`reasoning_effort` from chat_template_kwargs, markers tokenized as special tokens), and returns
the analysis channel as reasoning and the final channel as content, whole and streamed."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from openai import AsyncOpenAI

from pagedserve.launch.redis_server import RedisServer
from tests.e2e.support import EngineProcess, GatewayProcess, start_engines
from tests.engine.model.test_gpt_oss import TINY
from tests.fixtures.scripted_model import make_scripted_model_dir

MODEL = "gpt-oss-scripted"
MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>")
HARMONY_TEMPLATE = (  # the shape of gpt-oss's template, cut down to what this test needs
    "<|start|>system<|message|>Reasoning: {{ reasoning_effort | default('medium') }}<|end|>"
    "{% for m in messages %}{% if m.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>"
    "{{ m.content }}<|end|>{% else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)
THOUGHT = "The user greets me."
ANSWER = "Hello! How can I help?"
# distinct tokens each: the second header is one plain token holding the markers' text
SCRIPT = ["<|channel|>", "analysis", "<|message|>", THOUGHT, "<|end|>", "<|start|>",
          "assistant<|channel|>final<|message|>", ANSWER, "<|return|>"]
ASK: list[Any] = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, EngineProcess]]:
    model_dir = make_scripted_model_dir(tmp_path_factory.mktemp("gpt-oss-scripted"), SCRIPT, HARMONY_TEMPLATE,
                                        trigger="t", special_tokens=MARKERS, model_type="gpt_oss", config=TINY)
    logs = tmp_path_factory.mktemp("e2e-reasoning-gpt-oss")
    with RedisServer() as server:
        [engine] = start_engines(model_dir, server.url, logs, ["harmony-0"], "--served-model-name", MODEL,
                                 "--kv-cache-memory", "16MiB")
        gateway = GatewayProcess(server.url, "harmony-gw", logs)
        try:
            gateway.wait_healthy()
            yield gateway.url, engine
        finally:
            gateway.stop()
            engine.stop()


async def test_harmony_prompt_and_channels(stack: tuple[str, EngineProcess]) -> None:
    url, engine = stack
    async with aiohttp.ClientSession() as http, http.post(f"{url}/tokenize", json={
            "model": MODEL, "messages": ASK, "chat_template_kwargs": {"reasoning_effort": "high"},
            "return_token_strs": True}) as resp:
        tokens = await resp.json()
    strs = tokens["token_strs"]
    assert "".join(strs).endswith("<|start|>user<|message|>Hi<|end|><|start|>assistant")
    assert "".join(strs).startswith("<|start|>system<|message|>Reasoning: high<|end|>")
    assert strs.count("<|start|>") == 3 and strs.count("<|message|>") == 2  # markers are single tokens

    args: dict[str, Any] = {"model": MODEL, "messages": ASK, "temperature": 0, "max_tokens": 20}
    async with AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
        reply = await client.chat.completions.create(**args)
        message = reply.choices[0].message
        assert getattr(message, "reasoning_content", None) == getattr(message, "reasoning", None) == THOUGHT
        assert message.content == ANSWER and reply.choices[0].finish_reason == "stop"

        reasoning = content = ""
        async for chunk in await client.chat.completions.create(stream=True, **args):
            for c in chunk.choices:
                assert "<|" not in (c.delta.content or ""), c.delta
                reasoning += getattr(c.delta, "reasoning", None) or ""
                content += c.delta.content or ""
        assert (reasoning, content) == (THOUGHT, ANSWER)
    engine.wait_drained()
