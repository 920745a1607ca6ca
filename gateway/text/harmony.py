"""gpt-oss's harmony output format read as text, the reasoning parser ``gpt_oss``.

After a prompt ending ``<|start|>assistant``, the model writes messages such as
``<|channel|>analysis<|message|>…<|end|>``, then ``<|start|>assistant<|channel|>final<|message|>…
<|return|>``, or a function call ``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>
{…}<|call|>``. The ``analysis`` channel is reasoning, ``final`` (and ``commentary`` without a
recipient: preambles) is content, and a ``functions.NAME`` recipient's message is a tool call.

Calls are handed on in the project's own call notation (``<tool_call>`` JSON blocks, see
`gateway.text.tool_parser`) inside the content, so one tool parser and call guard serve every
model. The markers are special tokens: this parser needs text decoded with them kept.

The `openai-harmony` package needs its o200k vocabulary from the internet at run time, so the
format is read here from the tokenizer's text instead."""

from __future__ import annotations

import json
import re

from gateway.text.think import ReasoningParser, Start
from gateway.text.tool_parser import partial_suffix
from gateway.text.tool_prompt import call_block

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
ENDS = ("<|end|>", "<|return|>", "<|call|>")
MARKERS = (START, CHANNEL, MESSAGE, CONSTRAIN, *ENDS)
MAX_HEADER = 1024  # characters of a header without <|message|> before the text is taken as plain content
# (text that does not open with a marker is plain content at once: a model not speaking harmony)
_CHANNEL = re.compile(r"<\|channel\|>\s*([\w.-]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


def _header_like(text: str) -> bool:
    """Whether `text` may be (the start of) a message header: it opens with a marker."""
    head = text.lstrip()
    return any(head.startswith(m) or m.startswith(head) for m in (START, CHANNEL))


class HarmonyReasoningParser(ReasoningParser):
    """Streaming reader of harmony messages: ``feed(text) -> (reasoning, content)``."""

    name = "gpt_oss"
    needs_special_tokens = True

    def __init__(self, start: Start = "model") -> None:
        super().__init__(start)
        self._in_body = False
        self._raw = False  # output that is not harmony: all content
        self._channel = ""
        self._recipient: str | None = None
        self._call_args = ""
        self._done = False  # past <|return|> or <|call|>: the answer is over (what follows is EOS text)

    def feed(self, text: str) -> tuple[str, str]:
        self._buf = "" if self._done else self._buf + text
        reasoning = content = ""
        while True:
            if self._done:
                self._buf = ""
                return reasoning, content
            if self._raw:
                content, self._buf = content + self._buf, ""
                return reasoning, content
            if not self._in_body:
                at = self._buf.find(MESSAGE)
                if not _header_like(self._buf) or (at < 0 and len(self._buf) > MAX_HEADER):
                    self._raw = True
                    continue
                if at < 0:
                    return reasoning, content
                self._header(self._buf[:at])
                self._buf, self._in_body = self._buf[at + len(MESSAGE):], True
                continue
            end, marker = min(((self._buf.find(m), m) for m in ENDS if m in self._buf), default=(-1, ""))
            if end >= 0:
                r, c = self._body(self._buf[:end])
                r2, c2 = self._close()
                reasoning, content = reasoning + r + r2, content + c + c2
                self._buf, self._in_body = self._buf[end + len(marker):], False
                self._done = marker != ENDS[0]
                continue
            keep = max(partial_suffix(self._buf, m) for m in ENDS)
            r, c = self._body(self._buf[:len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep:]
            return reasoning + r, content + c

    def finish(self) -> tuple[str, str]:
        """At the end: an open message ends there (max_tokens); a header alone is dropped."""
        if self._done:
            return "", ""
        if self._raw or not self._in_body:
            rest, self._buf = self._buf, ""
            plain = not any(m in rest for m in MARKERS) and not self._channel
            return "", rest if plain or self._raw else ""
        rest, self._buf = self._buf, ""
        r, c = self._body(rest)
        r2, c2 = self._close()
        return r + r2, c + c2

    def _header(self, header: str) -> None:
        """Channel and recipient of the message this header opens."""
        found = _CHANNEL.search(header)
        self._channel = found.group(1) if found else "final"
        to = _RECIPIENT.search(header)
        self._recipient = to.group(1) if to else None
        self._call_args = ""

    def _body(self, text: str) -> tuple[str, str]:
        if self._recipient is not None:
            self._call_args += text
            return "", ""
        return (text, "") if self._channel == "analysis" else ("", text)

    def _close(self) -> tuple[str, str]:
        """The end of a message: a function call becomes a call block in the content."""
        recipient, self._recipient = self._recipient, None
        if recipient is None:
            return "", ""
        args = self._call_args.strip()
        try:
            json.loads(args)
        except ValueError:  # not JSON: handed on as a string, as the tool parser reads it
            args = json.dumps(args, ensure_ascii=False)
        return "", call_block(recipient.removeprefix("functions."), args)
