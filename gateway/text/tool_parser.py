"""Tool calls out of generated text, Hermes/Qwen style: each call is a JSON object
``{"name": ..., "arguments": {...}}`` inside ``<tool_call>``…``</tool_call>``.

`ToolCallParser` is fed text deltas and returns the content to show (the calls cut out) and
the calls completed so far, so streaming and non-streaming read output the same way. A block
whose JSON is not a call is given back as content, as written. Whitespace is held back until
it is known not to be the gap before or between calls. With `calls_only` (a grammar made the
whole output calls: tool_choice required or named) nothing is ever content: a block cut off
by max_tokens is dropped, not shown as markup."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One parsed call; `arguments` is JSON text, as OpenAI sends it."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


def parse_call(text: str) -> ToolCall | None:
    """The call in one block's text, or None when it is not ``{"name": str, "arguments": ...}``."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        return ToolCall(obj["name"], args)
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


class ToolCallParser:
    """Incremental parser of one choice's output."""

    def __init__(self, calls_only: bool = False) -> None:
        self.calls_only = calls_only
        self.calls: list[ToolCall] = []
        self._buf = ""  # text not yet classified
        self._ws = ""  # whitespace held back
        self._inside = False

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """New content to show and calls completed by this text."""
        self._buf += text
        content, new = "", list[ToolCall]()
        while True:
            if self._inside:
                end = self._buf.find(CLOSE)
                if end < 0:
                    return content, new
                content += self._close(self._buf[:end], new)
                self._buf = self._buf[end + len(CLOSE):]
                continue
            start = self._buf.find(OPEN)
            if start >= 0:
                content += self._text(self._buf[:start])
                self._ws, self._buf, self._inside = "", self._buf[start + len(OPEN):], True
                continue
            keep = partial_suffix(self._buf, OPEN)
            content += self._text(self._buf[:len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep:]
            return content, new

    def finish(self) -> tuple[str, list[ToolCall]]:
        """End of output: an unclosed block still counts when its JSON is a whole call."""
        new: list[ToolCall] = []
        content = self._close(self._buf, new, closed=False) if self._inside else self._text(self._buf)
        self._buf, self._inside = "", False
        if not self.calls:
            content += self._ws
        self._ws = ""
        return content, new

    def _close(self, block: str, new: list[ToolCall], closed: bool = True) -> str:
        self._inside = False
        call = parse_call(block.strip())
        if call is None:
            return "" if self.calls_only else self._text(OPEN + block + (CLOSE if closed else ""))
        self.calls.append(call)
        new.append(call)
        return ""

    def _text(self, text: str) -> str:
        """Plain text: emit it with the held whitespace unless it is all whitespace (hold it)."""
        if not text or self.calls_only:
            return ""
        if not text.strip():
            self._ws += text
            return ""
        stripped = text.rstrip()
        out = self._ws + stripped
        self._ws = text[len(stripped):]
        return out


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0
