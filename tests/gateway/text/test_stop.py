"""Stop strings across token boundaries."""

from __future__ import annotations

import pytest

from gateway.text.stop import StopMatcher


def _run(stops: list[str], pieces: list[str]) -> tuple[str, str | None, list[str]]:
    matcher = StopMatcher(stops)
    emitted = [matcher.feed(p) for p in pieces]
    emitted.append(matcher.flush())
    return "".join(emitted), matcher.matched, emitted


@pytest.mark.parametrize(("pieces", "expected"), [
    (["Hello ", "ST", "OP", " more"], "Hello "),
    (["Hello S", "T", "O", "P"], "Hello "),
    (["HelloSTOPmore"], "Hello"),
    (["S", "TOP"], ""),
])
def test_stop_across_tokens(pieces: list[str], expected: str) -> None:
    text, matched, _ = _run(["STOP"], pieces)
    assert text == expected and matched == "STOP"


def test_held_text_released_when_not_a_stop() -> None:
    text, matched, emitted = _run(["STOP"], ["a S", "T", "x", " end ST"])
    assert text == "a STx end ST" and matched is None
    assert emitted[0] == "a " and emitted[1] == ""  # "S", "ST" held back until disproved


def test_earliest_of_several_stops_wins() -> None:
    text, matched, _ = _run(["world", "lo w"], ["hel", "lo wor", "ld"])
    assert text == "hel" and matched == "lo w"


def test_nothing_after_match() -> None:
    matcher = StopMatcher(["\n\n"])
    assert matcher.feed("a\n") == "a"
    assert matcher.feed("\nb") == ""
    assert matcher.feed("c") == "" and matcher.flush() == ""


def test_no_stops_passes_through() -> None:
    assert _run([], ["a", "b"])[0] == "ab"
