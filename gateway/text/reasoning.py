"""Reasoning kept apart from the answer, as vLLM's ``--reasoning-parser`` does: the thinking a
model writes inside ``<think>``…``</think>`` goes to `reasoning_content`, the rest to `content`.

Interface (also used by other endpoints): ``get_reasoning_parser(name)`` gives a class; make one
instance per choice, with where the generation starts (`prompt_start` of the text the chat
template appended for the answer), then either stream through it, ``feed(delta) ->
(reasoning_delta, content_delta)`` and ``finish()`` at the end, or ``split(text) -> (reasoning or
None, content)`` once. Both give the same split, whatever the deltas' cuts: only text that could
still be a tag is held back. Which parser a served model uses: `gateway.api.reasoning.parser_name`.

- ``deepseek_r1``: everything before ``</think>`` is reasoning (a leading ``<think>`` dropped),
  also when the model never wrote ``<think>`` (the template opened it) and when it never closes.
- ``qwen3``: reasoning only inside a ``<think>`` the output opens with (or the prompt opened);
  an answer without one is all content.
- ``gpt_oss``: the harmony channels (`gateway.text.harmony`).

When the prompt closed the thinking itself (Qwen3 with ``enable_thinking: false`` renders an empty
``<think></think>``), the whole output is content. Whitespace around the reasoning and at the
start of the answer after ``</think>`` is dropped."""

from __future__ import annotations

from common.protocol import REASONING_PARSER_NAMES
from gateway.text.harmony import HarmonyReasoningParser
from gateway.text.think import (
    CLOSE,
    OPEN,
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
    ReasoningParser,
    Start,
    prompt_start,
)

_PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p for p in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser, HarmonyReasoningParser)}


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser class called `name` (one of `REASONING_PARSER_NAMES`); KeyError otherwise."""
    if name not in _PARSERS:
        raise KeyError(f"unknown reasoning parser {name!r}; known: {sorted(_PARSERS)}")
    return _PARSERS[name]


def template_default(chat_template: str | None) -> str | None:
    """The parser a chat template implies where it is unambiguous: harmony markers → gpt_oss;
    think tags with an `enable_thinking` switch → qwen3, without one → deepseek_r1."""
    if not chat_template:
        return None
    if "<|channel|>" in chat_template and "<|message|>" in chat_template:
        return "gpt_oss"
    if OPEN not in chat_template and CLOSE not in chat_template:
        return None
    return "qwen3" if "enable_thinking" in chat_template else "deepseek_r1"


__all__ = ["CLOSE", "OPEN", "REASONING_PARSER_NAMES", "ReasoningParser", "Start", "get_reasoning_parser",
           "prompt_start", "template_default"]
