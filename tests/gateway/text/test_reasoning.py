"""The reasoning parsers: deepseek_r1 and qwen3 on whole outputs (tags, no tags, an unterminated
think, a think the prompt opened or closed), and streamed: every way of cutting the text into
deltas (tags cut anywhere) gives the whole output's split, and nothing that cannot be a tag is
held back. Plus `prompt_start` on generation prompts and the template defaults."""

from __future__ import annotations

import pytest

from common.protocol import REASONING_PARSER_NAMES
from gateway.text.reasoning import get_reasoning_parser, prompt_start, template_default

CASES = [  # parser, start, output, (reasoning, content)
    ("deepseek_r1", "model", "<think>\nLet me see.\n</think>\n\nThe answer.", ("Let me see.", "The answer.")),
    ("deepseek_r1", "model", "Let me see.</think>The answer.", ("Let me see.", "The answer.")),
    ("deepseek_r1", "model", "no tags at all", ("no tags at all", "")),
    ("deepseek_r1", "model", "<think>cut off by max_tokens", ("cut off by max_tokens", "")),
    ("deepseek_r1", "reasoning", "thinking\n</think>\nAnswer", ("thinking", "Answer")),
    ("deepseek_r1", "reasoning", "<think>again</think>Answer", ("again", "Answer")),
    ("deepseek_r1", "content", "<think>x</think>Answer", (None, "<think>x</think>Answer")),
    ("qwen3", "model", "<think>\nhmm\n</think>\n\nAnswer <think> stays", ("hmm", "Answer <think> stays")),
    ("qwen3", "model", "Answer without thinking.", (None, "Answer without thinking.")),
    ("qwen3", "model", "  leading space kept", (None, "  leading space kept")),
    ("qwen3", "model", "no open tag</think>so content", (None, "no open tag</think>so content")),
    ("qwen3", "model", "<think>unterminated", ("unterminated", "")),
    ("qwen3", "model", "<think></think>Answer", (None, "Answer")),
    ("qwen3", "model", "<thin", (None, "<thin")),
    ("qwen3", "reasoning", "opened by the prompt</think>Answer", ("opened by the prompt", "Answer")),
    ("qwen3", "content", "\n\nAnswer", (None, "\n\nAnswer")),
    ("qwen3", "model", "<think>a </thi nk> b</think>c", ("a </thi nk> b", "c")),
]


@pytest.mark.parametrize(("name", "start", "text", "expected"), CASES)
def test_split(name: str, start: str, text: str, expected: tuple[str | None, str]) -> None:
    assert get_reasoning_parser(name)(start).split(text) == expected  # type: ignore[arg-type]


def _stream(name: str, start: str, deltas: list[str]) -> tuple[str, str]:
    parser = get_reasoning_parser(name)(start)  # type: ignore[arg-type]
    reasoning = content = ""
    for delta in deltas:
        r, c = parser.feed(delta)
        reasoning, content = reasoning + r, content + c
    r, c = parser.finish()
    return reasoning + r, content + c


@pytest.mark.parametrize(("name", "start", "text", "expected"), CASES)
def test_every_cut_streams_the_same(name: str, start: str, text: str, expected: tuple[str | None, str]) -> None:
    whole = (expected[0] or "", expected[1])
    assert _stream(name, start, list(text)) == whole  # one character per delta
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            assert _stream(name, start, [text[:i], text[i:j], text[j:]]) == whole, (i, j)


def test_only_a_possible_tag_is_held() -> None:
    parser = get_reasoning_parser("qwen3")()
    assert parser.feed("<thi") == ("", "")
    assert parser.feed("nk>Let me") == ("Let me", "")
    assert parser.feed(" think </thi") == (" think", "")  # the space waits: it may end the reasoning
    assert parser.feed("s is not a tag") == (" </this is not a tag", "")
    assert parser.feed("</thi") == ("", "")
    assert parser.feed("nk>\n\nThe") == ("", "The")
    assert parser.feed(" answer") == ("", " answer")
    assert parser.finish() == ("", "")


def test_an_answer_without_thinking_streams_at_once() -> None:
    parser = get_reasoning_parser("qwen3")()
    assert parser.feed("Hello") == ("", "Hello")
    assert parser.feed(" world") == ("", " world")
    deepseek = get_reasoning_parser("deepseek_r1")()
    assert deepseek.feed("Thinking") == ("Thinking", "")


@pytest.mark.parametrize(("added", "start"), [
    ("<|im_start|>assistant\n", "model"),
    ("<|im_start|>assistant\n<think>\n", "reasoning"),
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", "content"),
    ("<｜Assistant｜><think>\n", "reasoning"),
])
def test_prompt_start(added: str, start: str) -> None:
    assert prompt_start(added) == start


def test_registry_and_template_defaults() -> None:
    assert sorted(REASONING_PARSER_NAMES) == sorted(get_reasoning_parser(n).name for n in REASONING_PARSER_NAMES)
    with pytest.raises(KeyError):
        get_reasoning_parser("nope")
    assert template_default(None) is None
    assert template_default("{{ messages }}<|im_start|>assistant\n") is None
    assert template_default("{% if enable_thinking is false %}<think>\n\n</think>{% endif %}") == "qwen3"
    assert template_default("<｜Assistant｜><think>\n ... </think>") == "deepseek_r1"
    assert template_default("<|start|>assistant<|channel|>final<|message|>") == "gpt_oss"
