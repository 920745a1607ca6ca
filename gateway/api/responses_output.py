"""One response's output, event by event: reasoning split off the generated text first (when a
reasoning parser is given), then tool calls cut out of the rest (`ChoiceOutput`, as chat does).
Each generation event becomes a `Step`, which `responses_events.OutputBuilder` turns into
output items (streamed or whole: the same code)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Protocol

from gateway.api.choice_output import ChoiceOutput
from gateway.api.generation import ChoiceEvent
from gateway.api.validation import GenerationRequest
from gateway.text.tokenizer import ModelTokenizer
from gateway.text.tool_parser import ToolCall


class ReasoningParser(Protocol):
    """Splits a model's reasoning from its answer, incrementally: `feed` takes new text and
    gives back (reasoning, content) deltas; `finish` gives back what it held at the end."""

    def feed(self, delta: str) -> tuple[str, str]: ...

    def finish(self) -> tuple[str, str]: ...


@dataclass(slots=True)
class Step:
    """What one generation event adds: reasoning text, answer text, completed calls, and on the
    last event the chat finish reason ("stop", "length", "tool_calls")."""

    reasoning: str = ""
    text: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    finish_reason: str | None = None


class ResponseOutput:
    """The one choice of a /v1/responses generation (see the module docstring)."""

    def __init__(self, req: GenerationRequest, tokenizer: ModelTokenizer,
                 reasoning: ReasoningParser | None = None) -> None:
        self.choice = ChoiceOutput(req, tokenizer)
        self.reasoning = reasoning
        self.reasoning_tokens = 0  # tokens of events whose text was all reasoning

    @property
    def finish_reason(self) -> str | None:
        return self.choice.finish_reason

    def feed(self, ev: ChoiceEvent) -> Step:
        thought = ""
        if self.reasoning is not None:
            thought, content = self.reasoning.feed(ev.text)
            if ev.ended:
                more_thought, more_content = self.reasoning.finish()
                thought, content = thought + more_thought, content + more_content
            if thought and not content:
                self.reasoning_tokens += len(ev.token_ids)
            ev = dataclasses.replace(ev, text=content)
        piece = self.choice.feed(ev, None)
        return Step(thought, piece.text, piece.calls, piece.finish_reason)
