"""gpt-oss's harmony output read as text (`gateway.text.harmony`): analysis → reasoning, final →
content, a commentary message to functions.NAME → a call block the tool parser reads; the same
split whatever the delta cuts (markers cut anywhere); a cut-off message still counts; output that
is not harmony is content."""

from __future__ import annotations

import json

import pytest

from gateway.text.harmony import HarmonyReasoningParser
from gateway.text.tool_parser import ToolCallParser

ANALYSIS = "<|channel|>analysis<|message|>User greets. Reply kindly.<|end|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>Hello! How can I help?<|return|>"
CALL = ("<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        '{"city":"Paris"}<|call|>')
CALL_BEFORE_CHANNEL = ('<|start|>assistant to=functions.add<|channel|>commentary json<|message|>{"a":1,"b":2}'
                       "<|call|>")
CASES = [
    (ANALYSIS + FINAL, ("User greets. Reply kindly.", "Hello! How can I help?")),
    (ANALYSIS + FINAL + "<|endoftext|>", ("User greets. Reply kindly.", "Hello! How can I help?")),
    ("<|channel|>final<|message|>No thinking.<|return|>", (None, "No thinking.")),
    ("<|channel|>analysis<|message|>cut off by max_tokens", ("cut off by max_tokens", "")),
    ("<|channel|>commentary<|message|>Let me look.<|end|>", (None, "Let me look.")),  # a preamble
    ("Plain text from a model that does not speak harmony", (None, "Plain text from a model that does not "
                                                                  "speak harmony")),
]


def _stream(deltas: list[str]) -> tuple[str, str]:
    parser = HarmonyReasoningParser()
    reasoning = content = ""
    for delta in deltas:
        r, c = parser.feed(delta)
        reasoning, content = reasoning + r, content + c
    r, c = parser.finish()
    return reasoning + r, content + c


@pytest.mark.parametrize(("text", "expected"), CASES)
def test_split_and_every_cut(text: str, expected: tuple[str | None, str]) -> None:
    assert HarmonyReasoningParser().split(text) == expected
    whole = (expected[0] or "", expected[1])
    assert _stream(list(text)) == whole
    for i in range(0, len(text) + 1, 3):
        for j in range(i, len(text) + 1, 5):
            assert _stream([text[:i], text[i:j], text[j:]]) == whole, (i, j)


@pytest.mark.parametrize(("call", "name", "args"), [(CALL, "get_weather", {"city": "Paris"}),
                                                    (CALL_BEFORE_CHANNEL, "add", {"a": 1, "b": 2})])
def test_function_calls_become_tool_calls(call: str, name: str, args: dict[str, object]) -> None:
    reasoning, content = HarmonyReasoningParser().split(ANALYSIS + call)
    assert reasoning == "User greets. Reply kindly."
    tools = ToolCallParser()
    shown = tools.feed(content)[0] + tools.finish()[0]
    assert shown == "" and [(c.name, json.loads(c.arguments)) for c in tools.calls] == [(name, args)]


def test_reasoning_streams_before_the_message_ends() -> None:
    parser = HarmonyReasoningParser()
    assert parser.feed("<|channel|>analysis<|mess") == ("", "")
    assert parser.feed("age|>Thinking") == ("Thinking", "")
    assert parser.feed(" more<|e") == (" more", "")
    assert parser.feed("nd|><|start|>assistant<|channel|>final<|message|>Hi") == ("", "Hi")
    assert parser.finish() == ("", "")
    plain = HarmonyReasoningParser()
    assert plain.feed("Plain") == ("", "Plain")  # not harmony: content at once
