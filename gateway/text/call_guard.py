"""Ending an answer at the right tool call. A grammar lets a `required` answer stop after any
whole call, but a small model at temperature 0 tends to repeat its call until max_tokens, and
an `auto` answer is not constrained at all. `CallGuard` watches a choice's text like a stop
string: the answer ends (finish "stop", shown as "tool_calls") before a ``<tool_call>`` block
that repeats an earlier call exactly (same name and arguments: never useful) or that would
exceed `max_calls`. Text from an open block is held back until the block closes."""

from __future__ import annotations

import json

from gateway.text.tool_parser import CLOSE, OPEN, parse_call, partial_suffix


class CallGuard:
    """Same interface as `StopMatcher`: `feed` returns the text safe to pass on, `matched` is
    set once the answer must end, `flush` gives back what is held at the end of generation."""

    def __init__(self, max_calls: int | None = None) -> None:
        self.max_calls = max_calls
        self.matched: str | None = None
        self._held = ""
        self._seen: set[tuple[str, str]] = set()
        self._calls = 0

    def feed(self, text: str) -> str:
        if self.matched is not None:
            return ""
        buf, out = self._held + text, ""
        while True:
            start = buf.find(OPEN)
            if start < 0:
                keep = partial_suffix(buf, OPEN)
                self._held = buf[len(buf) - keep:]
                return out + buf[:len(buf) - keep]
            end = buf.find(CLOSE, start)
            if end < 0:
                self._held = buf[start:]
                return out + buf[:start]
            block = buf[start + len(OPEN):end]
            if self._ends_before(block):
                self.matched, self._held = OPEN, ""
                return out + buf[:start]
            out, buf = out + buf[:end + len(CLOSE)], buf[end + len(CLOSE):]

    def flush(self) -> str:
        held, self._held = self._held, ""
        return "" if self.matched is not None else held

    def _ends_before(self, block: str) -> bool:
        call = parse_call(block.strip())
        if call is None:  # not a call: the parser shows it as text
            return False
        try:
            key = (call.name, json.dumps(json.loads(call.arguments), sort_keys=True))
        except ValueError:
            key = (call.name, call.arguments)
        if key in self._seen or (self.max_calls is not None and self._calls >= self.max_calls):
            return True
        self._seen.add(key)
        self._calls += 1
        return False
