"""Thinking inside ``<think>``…``</think>`` split from the answer: the `ReasoningParser` base
(streaming ``feed`` / ``finish``, whole ``split``) and the ``deepseek_r1`` and ``qwen3`` rules
(see `gateway.text.reasoning` for the interface and the rules)."""

from __future__ import annotations

from typing import ClassVar, Literal

from gateway.text.tool_parser import partial_suffix

OPEN, CLOSE = "<think>", "</think>"
Start = Literal["model", "reasoning", "content"]  # who decides / the prompt opened / the prompt closed
_State = Literal["start", "reasoning", "content"]


def prompt_start(generation_prompt: str) -> Start:
    """Where generated text starts, from the text the chat template appended for the answer: in
    reasoning when its last think tag opens, in content when it closes, else the model decides."""
    opened, closed = generation_prompt.rfind(OPEN), generation_prompt.rfind(CLOSE)
    if opened < 0 and closed < 0:
        return "model"
    return "reasoning" if opened > closed else "content"


class ReasoningParser:
    """Streaming split of one choice's text (the interface: `gateway.text.reasoning`)."""

    name: ClassVar[str] = ""
    # what an output that does not open with <think> is until </think>: reasoning or content
    unopened: ClassVar[_State] = "content"
    needs_special_tokens: ClassVar[bool] = False  # read text decoded with the special tokens kept

    def __init__(self, start: Start = "model") -> None:
        self._state: _State = "content" if start == "content" else "start"
        # a prompt that opened <think> makes an unopened output reasoning (a repeated <think> dropped)
        self._unopened: _State = "reasoning" if start == "reasoning" else self.unopened
        self._buf = ""  # text not yet given out (a possible tag, or whitespace held back)
        self._answer_started = start == "content"  # past the whitespace that opens the answer
        self._reasoning_started = False  # reasoning text given out yet

    def feed(self, text: str) -> tuple[str, str]:
        """The reasoning and the content that `text` adds."""
        self._buf += text
        reasoning = ""
        while True:
            if self._state == "start":
                head = self._buf.lstrip()
                if head.startswith(OPEN):
                    self._buf, self._state = head[len(OPEN):], "reasoning"
                    continue
                if OPEN.startswith(head):  # empty, whitespace or a cut <think>: wait
                    return reasoning, ""
                self._leave_start()
                continue
            if self._state == "reasoning":
                end = self._buf.find(CLOSE)
                if end >= 0:
                    reasoning += self._reasoning_piece(self._buf[:end])[0]
                    self._buf, self._state = self._buf[end + len(CLOSE):], "content"
                    continue
                cut = len(self._buf) - partial_suffix(self._buf, CLOSE)
                out, held = self._reasoning_piece(self._buf[:cut])
                self._buf = held + self._buf[cut:]
                return reasoning + out, ""
            return reasoning, self._content_text()

    def finish(self) -> tuple[str, str]:
        """What is still held at the end of the output."""
        if self._state == "start":  # whitespace or part of "<think>": not a tag after all
            self._leave_start()
        if self._state == "reasoning":
            text, self._buf = self._buf, ""
            return self._reasoning_piece(text)[0], ""
        return "", self._content_text()

    def split(self, text: str) -> tuple[str | None, str]:
        """The whole output's reasoning (None when there was none) and content."""
        r1, c1 = self.feed(text)
        r2, c2 = self.finish()
        return r1 + r2 or None, c1 + c2

    def _leave_start(self) -> None:
        """The output does not open with <think>: what it is until </think> is the parser's rule."""
        self._state = self._unopened
        if self._unopened == "content":
            self._answer_started = True  # an answer without thinking is passed on as written

    def _reasoning_piece(self, text: str) -> tuple[str, str]:
        """Reasoning to give out and trailing whitespace to hold (given out once more reasoning
        follows, dropped at its end); the reasoning's leading whitespace is dropped."""
        if not self._reasoning_started:
            text = text.lstrip()
            self._reasoning_started = bool(text)
        body = text.rstrip()
        return body, text[len(body):]

    def _content_text(self) -> str:
        """The answer so far, the whitespace that opens it after </think> dropped."""
        text, self._buf = self._buf, ""
        if not self._answer_started:
            text = text.lstrip()
            self._answer_started = bool(text)
        return text


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    unopened = "reasoning"


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    unopened = "content"
