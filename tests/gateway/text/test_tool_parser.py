"""The Hermes-style tool-call parser: the same calls and content however the text is split
into deltas (streaming equals non-streaming), malformed blocks stay content."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from gateway.text.tool_parser import ToolCallParser, parse_call
from gateway.text.tool_prompt import call_block, fallback_messages

CALL = '<tool_call>\n{"name": "f", "arguments": {"x": [1, "</tool"]}}\n</tool_call>'
TEXTS = ["Hello world", "Sure. " + CALL, CALL + "\n" + CALL.replace('"f"', '"g"'), "a <tool b", "<tool_call>{bad}",
         "x\n\n" + CALL + "\n\ny", "<tool_call>\n" + '{"name": "h", "arguments": {}}']


def _run(text: str, cuts: list[int]) -> tuple[str, list[tuple[str, str]]]:
    parser, content, calls, last = ToolCallParser(), "", [], 0
    for cut in [*sorted(c % (len(text) + 1) for c in cuts), len(text)]:
        piece, new = parser.feed(text[last:cut]) if cut >= last else ("", [])
        content, calls, last = content + piece, calls + new, max(last, cut)
    piece, new = parser.finish()
    return content + piece, [(c.name, c.arguments) for c in calls + new]


@given(st.sampled_from(TEXTS), st.lists(st.integers(0, 200), max_size=12))
def test_split_does_not_matter(text: str, cuts: list[int]) -> None:
    assert _run(text, cuts) == _run(text, [])


def test_what_is_parsed() -> None:
    assert _run("Hello world", []) == ("Hello world", [])
    assert _run("Sure. " + CALL, []) == ("Sure.", [("f", '{"x": [1, "</tool"]}')])
    assert [n for n, _ in _run(TEXTS[2], [])[1]] == ["f", "g"] and _run(TEXTS[2], [])[0] == ""
    assert _run("a <tool b", []) == ("a <tool b", [])
    assert _run("<tool_call>{bad}", []) == ("<tool_call>{bad}", [])  # unclosed and not a call: content
    assert _run("x\n\n" + CALL + "\n\ny", []) == ("x\n\ny", [("f", '{"x": [1, "</tool"]}')])
    assert _run(TEXTS[6], []) == ("", [("h", "{}")])  # EOS before the closing tag still counts


def test_parse_call_shapes() -> None:
    assert parse_call('{"name": "f", "arguments": "{\\"a\\": 1}"}').arguments == '{"a": 1}'  # type: ignore[union-attr]
    assert parse_call('{"name": "f", "parameters": {"a": 1}}').arguments == '{"a": 1}'  # type: ignore[union-attr]
    for bad in ("[]", '{"name": 3}', '{"arguments": {}}', "nope", '{"name": ""}'):
        assert parse_call(bad) is None


def test_fallback_prompt_round_trips_through_the_parser() -> None:
    """What the model is shown as an earlier call is what the parser reads back."""
    block = call_block("get_weather", '{"city": "Paris"}')
    assert _run(block, []) == ("", [("get_weather", json.dumps({"city": "Paris"}))])
    messages = fallback_messages([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
                                 [{"type": "function", "function": {"name": "f"}}], "You must call f.")
    assert messages[0]["content"].startswith("Be brief.\n\n# Tools") and messages[0]["content"].endswith("call f.")


GUARDED = [CALL + "\n" + CALL, "Hi " + CALL + CALL.replace('"f"', '"g"') + "\n" + CALL + " tail", "no calls <tool",
           CALL.replace("[1,", "[2,") + CALL + "<tool_call>\n{cut"]


def _guarded(text: str, cuts: list[int], max_calls: int | None) -> tuple[str, str | None]:
    from gateway.text.call_guard import CallGuard

    guard, out, last = CallGuard(max_calls), "", 0
    for cut in [*sorted(c % (len(text) + 1) for c in cuts), len(text)]:
        out, last = out + guard.feed(text[last:max(last, cut)]), max(last, cut)
    return out + guard.flush(), guard.matched


@given(st.sampled_from(GUARDED), st.lists(st.integers(0, 300), max_size=12), st.sampled_from([None, 1, 2]))
def test_call_guard_split_does_not_matter(text: str, cuts: list[int], max_calls: int | None) -> None:
    assert _guarded(text, cuts, max_calls) == _guarded(text, [], max_calls)


def test_call_guard_cuts_before_a_repeat_or_an_extra_call() -> None:
    assert _guarded(CALL + "\n" + CALL, [], None) == (CALL + "\n", "<tool_call>")
    two = CALL + CALL.replace('"f"', '"g"')
    assert _guarded(two, [], None) == (two, None)
    assert _guarded(two, [], 1) == (CALL, "<tool_call>")
    assert _guarded("x <tool_call>\n{cut", [], 1) == ("x <tool_call>\n{cut", None)  # held, given back at the end
