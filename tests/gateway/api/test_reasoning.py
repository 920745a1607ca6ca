"""Reasoning split on the gateway, against a scripted engine that sends the output one token per
message (the test tokenizer is nearly byte-level, so the think tags arrive cut into pieces): the
thinking comes back as `reasoning_content` and `reasoning`, whole and streamed, `content` holds the
answer only; tool calls are read from the answer alone; `enable_thinking` reaches the template and
a prompt that opens or closes the thinking is honoured; an output constraint while the model thinks
is refused; where the parser comes from (template, engine heartbeat, the gateway's flag)."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from openai import AsyncOpenAI

from gateway.text.tokenizer import ModelTokenizer
from tests.fixtures.gateway import MODEL, Gateway, open_gateway, parse_sse

# Qwen3's shape: tools rendered natively, `enable_thinking: false` closes an empty think block
QWEN3_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTOOLS:{% for t in tools %} {{ t.function.name }}{% endfor %}<|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
# DeepSeek-R1's shape: the generation prompt opens the thinking; an earlier turn's thinking rendered back
R1_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.reasoning_content %}<think>{{ m.reasoning_content }}"
    "</think>{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)
MSG = [{"role": "user", "content": "Hi"}]
THOUGHT = "<think>\nThe user greets me. I greet back.\n</think>\n\nHello there!"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]


def _tokenizer_dir(source: Path, into: Path, template: str) -> Path:
    into.mkdir(exist_ok=True)
    shutil.copy(source / "tokenizer.json", into / "tokenizer.json")
    config = json.loads((source / "tokenizer_config.json").read_text())
    (into / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return into


@pytest.fixture
async def qwen3(redis_server: str, tiny_tokenizer_dir: Path, tmp_path: Path) -> AsyncIterator[Gateway]:
    """A model whose template implies the qwen3 parser (no flag anywhere)."""
    async with open_gateway(redis_server, _tokenizer_dir(tiny_tokenizer_dir, tmp_path / "q", QWEN3_TEMPLATE)) as gw:
        gw.engine.max_model_len = 4096
        await gw.engine.beat()
        yield gw


async def _run(gw: Gateway, body: dict[str, Any], texts: list[str]) -> tuple[int, Any, str]:
    """Post a chat request, let the scripted engine answer `texts` one token per message; the
    status, the JSON body (or the SSE events when streamed) and the prompt the engine got."""
    post = asyncio.create_task(gw.client.post("/v1/chat/completions", json={"model": MODEL, "messages": MSG,
                                                                            **body}))
    req = await gw.engine.next_request()
    await gw.engine.generate(req, texts)
    resp = await post
    prompt = ModelTokenizer(gw.engine.tokenizer_dir).decode(req.prompt_token_ids, False)
    if body.get("stream"):
        return resp.status, [e for e in parse_sse(await resp.text()) if e != "[DONE]"], prompt
    return resp.status, await resp.json(), prompt


def _streamed(events: list[dict[str, Any]], index: int = 0) -> tuple[str, str, str, list[dict[str, Any]]]:
    """Joined reasoning, reasoning_content and content deltas of one choice, and its deltas."""
    deltas = [c["delta"] for e in events for c in e["choices"] if c["index"] == index]
    def joined(key: str) -> str:
        return "".join(d.get(key) or "" for d in deltas)

    return joined("reasoning"), joined("reasoning_content"), joined("content"), deltas


async def test_whole_and_streamed_split(qwen3: Gateway) -> None:
    status, body, _ = await _run(qwen3, {}, [THOUGHT])
    assert status == 200, body
    message = body["choices"][0]["message"]
    assert message["reasoning_content"] == message["reasoning"] == "The user greets me. I greet back."
    assert message["content"] == "Hello there!" and body["choices"][0]["finish_reason"] == "stop"
    whole_usage = body["usage"]

    status, events, _ = await _run(qwen3, {"stream": True, "stream_options": {"include_usage": True}}, [THOUGHT])
    reasoning, reasoning_content, content, deltas = _streamed(events)
    assert reasoning == reasoning_content == message["reasoning"] and content == message["content"]
    assert not any("think>" in (d.get("content") or "") + (d.get("reasoning") or "") for d in deltas)
    assert sum(1 for d in deltas if d.get("reasoning")) > 3  # streamed as it came, not at the end
    assert events[-1]["usage"]["completion_tokens"] == whole_usage["completion_tokens"]


async def test_no_thinking_is_all_content(qwen3: Gateway) -> None:
    _, body, _ = await _run(qwen3, {}, ["Just an answer </think> with a stray tag"])
    message = body["choices"][0]["message"]
    assert message["content"] == "Just an answer </think> with a stray tag"
    assert message["reasoning_content"] is None and message["reasoning"] is None


async def test_each_choice_is_split_on_its_own(qwen3: Gateway) -> None:
    _, events, _ = await _run(qwen3, {"n": 2, "stream": True}, [THOUGHT, "<think>other</think>Bye"])
    assert _streamed(events, 0)[0::2][:2] == ("The user greets me. I greet back.", "Hello there!")
    assert _streamed(events, 1)[0::2][:2] == ("other", "Bye")


async def test_enable_thinking_false_closes_the_thinking(qwen3: Gateway) -> None:
    kwargs = {"chat_template_kwargs": {"enable_thinking": False}}
    _, body, prompt = await _run(qwen3, kwargs, ["<think>not thinking</think>Answer"])
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    message = body["choices"][0]["message"]
    assert message["content"] == "<think>not thinking</think>Answer" and message["reasoning_content"] is None
    _, _, prompt = await _run(qwen3, {}, ["x"])
    assert prompt.endswith("<|im_start|>assistant\n")


async def test_tool_calls_come_from_the_answer_only(qwen3: Gateway) -> None:
    """A call written while thinking is neither a call nor counted: with one call allowed, the
    answer's call still comes back."""
    thinking_call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    answer_call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    text = f"<think>Maybe {thinking_call} no, Paris.</think>\n{answer_call}"
    body = {"tools": TOOLS, "parallel_tool_calls": False}
    _, whole, prompt = await _run(qwen3, body, [text])
    assert "TOOLS: get_weather" in prompt
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert [json.loads(c["function"]["arguments"]) for c in choice["message"]["tool_calls"]] == [{"city": "Paris"}]
    assert choice["message"]["reasoning_content"] == f"Maybe {thinking_call} no, Paris."

    _, events, _ = await _run(qwen3, {**body, "stream": True}, [text])
    reasoning, _, content, deltas = _streamed(events)
    calls = [tc for d in deltas for tc in d.get("tool_calls") or []]
    assert reasoning == f"Maybe {thinking_call} no, Paris." and content == ""
    assert "".join(tc["function"].get("arguments") or "" for tc in calls) == '{"city": "Paris"}'


@pytest.mark.parametrize("constraint", [{"response_format": {"type": "json_object"}},
                                        {"tools": TOOLS, "tool_choice": "required"}])
async def test_constraint_while_thinking_is_refused(qwen3: Gateway, constraint: dict[str, Any]) -> None:
    resp = await qwen3.client.post("/v1/chat/completions", json={"model": MODEL, "messages": MSG, **constraint})
    assert resp.status == 400
    error = (await resp.json())["error"]
    assert "not supported" in error["message"] and "enable_thinking" in error["message"]
    assert error["param"] in ("response_format", "tool_choice")
    # with the thinking closed by the prompt the constraint applies to the answer: accepted
    status, body, _ = await _run(qwen3, {**constraint, "chat_template_kwargs": {"enable_thinking": False}}, ["{}"])
    assert status == 200, body


async def test_prompt_that_opens_the_thinking(redis_server: str, tiny_tokenizer_dir: Path, tmp_path: Path) -> None:
    """DeepSeek-R1's template opens <think>: the model writes only the closing tag."""
    async with open_gateway(redis_server, _tokenizer_dir(tiny_tokenizer_dir, tmp_path / "r1", R1_TEMPLATE)) as gw:
        await gw.engine.beat()
        _, body, _ = await _run(gw, {}, ["Thinking it over.\n</think>\n\nDone."])
        message = body["choices"][0]["message"]
        assert (message["reasoning_content"], message["content"]) == ("Thinking it over.", "Done.")
        _, events, _ = await _run(gw, {"stream": True}, ["Still thinking when cut off"])
        assert _streamed(events)[0::2][:2] == ("Still thinking when cut off", "")
        # a response's message sent back: its thinking reaches the template
        history = [*MSG, {"role": "assistant", "content": "Done.", "reasoning": "Thinking it over."},
                   {"role": "user", "content": "Again"}]
        _, _, prompt = await _run(gw, {"messages": history}, ["x</think>y"])
        assert "<|im_start|>assistant\n<think>Thinking it over.</think>Done.<|im_end|>" in prompt
        resp = await gw.client.post("/v1/chat/completions", json={"model": MODEL, "messages": [
            *MSG, {"role": "assistant", "content": "x", "reasoning_content": 3}]})
        assert resp.status == 400 and (await resp.json())["error"]["param"] == "messages[1].reasoning_content"


@pytest.mark.parametrize(("announced", "flag", "split"), [
    ("", (), False),  # the template has no think tags
    ("deepseek_r1", (), True),  # the engine's --reasoning-parser
    ("deepseek_r1", (("", "none"),), False),  # the gateway's flag wins
    ("", ((MODEL, "deepseek_r1"),), True),
])
async def test_where_the_parser_comes_from(redis_server: str, tiny_tokenizer_dir: Path, announced: str,
                                           flag: tuple[tuple[str, str], ...], split: bool) -> None:
    async with open_gateway(redis_server, tiny_tokenizer_dir, reasoning_parsers=flag) as gw:
        gw.engine.reasoning_parser = announced
        await gw.engine.beat()
        _, body, _ = await _run(gw, {}, ["No open tag</think>Answer"])
        message = body["choices"][0]["message"]
        if split:
            assert (message["reasoning_content"], message["content"]) == ("No open tag", "Answer")
        else:
            assert message["content"] == "No open tag</think>Answer" and "reasoning_content" not in message
        completion = asyncio.create_task(gw.client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi"}))
        await gw.engine.generate(await gw.engine.next_request(), [THOUGHT])
        assert (await (await completion).json())["choices"][0]["text"] == THOUGHT  # completions: raw text


async def test_openai_client_reads_the_fields(qwen3: Gateway) -> None:
    client = AsyncOpenAI(base_url=str(qwen3.client.make_url("/v1")), api_key="x", max_retries=0, timeout=20)
    post = asyncio.create_task(client.chat.completions.create(model=MODEL, messages=MSG))  # type: ignore[arg-type]
    await qwen3.engine.generate(await qwen3.engine.next_request(), [THOUGHT])
    message = (await post).choices[0].message
    assert message.content == "Hello there!"
    assert getattr(message, "reasoning_content", None) == "The user greets me. I greet back."


HARMONY_TEMPLATE = (  # gpt-oss's shape (its channels imply the gpt_oss parser)
    "{% for m in messages %}{% if m.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>"
    "{{ m.content }}<|end|>{% else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endif %}{% endfor %}"
    "{% if tools %}<|start|>developer<|message|>functions:{% for t in tools %} {{ t.function.name }}{% endfor %}"
    "<|end|>{% endif %}{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)
HARMONY_MARKERS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>"]


@pytest.fixture
async def gpt_oss(redis_server: str, tiny_tokenizer_dir: Path, tmp_path: Path) -> AsyncIterator[Gateway]:
    """A tokenizer with harmony's markers as special tokens and a harmony template."""
    from tokenizers import Tokenizer

    path = _tokenizer_dir(tiny_tokenizer_dir, tmp_path / "oss", HARMONY_TEMPLATE)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_special_tokens(HARMONY_MARKERS)
    tok.save(str(path / "tokenizer.json"))
    async with open_gateway(redis_server, path) as gw:
        gw.engine.max_model_len = 4096
        await gw.engine.beat()
        yield gw


async def test_harmony_channels_and_function_calls(gpt_oss: Gateway) -> None:
    analysis = "<|channel|>analysis<|message|>Need the weather tool.<|end|>"
    call = ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
            '{"city":"Paris"}<|call|>')
    final = "<|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>"
    _, body, prompt = await _run(gpt_oss, {}, [analysis + final])
    assert prompt.endswith("<|start|>user<|message|>Hi<|end|><|start|>assistant")
    message = body["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("Need the weather tool.", "It is sunny.")

    for stream in (False, True):
        _, out, prompt = await _run(gpt_oss, {"tools": TOOLS, "stream": stream}, [analysis + call])
        assert "functions: get_weather" in prompt
        if stream:
            reasoning, _, content, deltas = _streamed(out)
            calls = [tc for d in deltas for tc in d.get("tool_calls") or []]
            args = "".join(tc["function"].get("arguments") or "" for tc in calls)
            assert (reasoning, content, calls[0]["function"]["name"]) == ("Need the weather tool.", "", "get_weather")
            assert json.loads(args) == {"city": "Paris"}
            assert [c["finish_reason"] for e in out for c in e["choices"] if c["finish_reason"]] == ["tool_calls"]
        else:
            choice = out["choices"][0]
            assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
            assert choice["message"]["reasoning_content"] == "Need the weather tool."
            assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                    for c in choice["message"]["tool_calls"]] == [("get_weather", {"city": "Paris"})]


def test_reasoning_parser_flags() -> None:
    """`pagedserve gateway --reasoning-parser [MODEL=]PARSER` (repeatable; a bare name is every
    model's, a model's own wins) and the engine's `--reasoning-parser`, which `up` passes on."""
    import argparse

    from engine.worker.cli import add_arguments as engine_arguments
    from gateway.cli import add_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    cfg = config_from_args(parser.parse_args(["--reasoning-parser", "qwen3", "--reasoning-parser", "r1=deepseek_r1"]))
    assert (cfg.reasoning_parser_for("any"), cfg.reasoning_parser_for("r1")) == ("qwen3", "deepseek_r1")
    assert config_from_args(parser.parse_args([])).reasoning_parser_for("any") is None
    for bad in ("nope", "=qwen3", "m=nope"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--reasoning-parser", bad])
    engine = argparse.ArgumentParser()
    engine_arguments(engine)
    assert engine.parse_args(["--reasoning-parser", "gpt_oss"]).reasoning_parser == "gpt_oss"
    with pytest.raises(SystemExit):
        engine.parse_args(["--reasoning-parser", "nope"])
