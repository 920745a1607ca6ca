"""One response's output, event by event: reasoning split off the generated text first (when a
reasoning parser is given), then tool calls cut out of the rest (`ChoiceOutput`, as chat does).
Each generation event becomes a `Step`, which `responses_events.OutputBuilder` turns into
output items (streamed or whole: the same code)."""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.api.choice_output import ChoiceOutput
from gateway.api.generation import ChoiceEvent
from gateway.api.validation import GenerationRequest
from gateway.text.tokenizer import ModelTokenizer
from gateway.text.tool_parser import ToolCall


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

    def __init__(self, req: GenerationRequest, tokenizer: ModelTokenizer) -> None:
        self.choice = ChoiceOutput(req, tokenizer)
        self.reasoning_tokens = 0  # tokens of events whose text was all reasoning

    @property
    def finish_reason(self) -> str | None:
        return self.choice.finish_reason

    def feed(self, ev: ChoiceEvent) -> Step:
        """`ev`'s thinking (split off by the request's reasoning parser in `Generation`) and answer."""
        if ev.reasoning and not ev.text:
            self.reasoning_tokens += len(ev.token_ids)
        piece = self.choice.feed(ev, None)
        return Step(ev.reasoning, piece.text, piece.calls, piece.finish_reason)
