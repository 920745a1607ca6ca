"""What one choice shows its client, event by event: the echoed prompt (completions with
`echo`), the thinking (chat with a reasoning parser), content with tool calls cut out (chat
with tools), the calls, logprobs, and
`finish_reason` ("tool_calls" when the model stopped after calling). Streaming sends each
`Piece`; the non-streaming response is built from the accumulated whole."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from common.protocol import TokenLogprob
from gateway.api.endpoint import Endpoint
from gateway.api.generation import ChoiceEvent, client_finish_reason
from gateway.api.responses import (
    TokenIdNames,
    TokenNames,
    chat_logprobs,
    completion_logprobs,
    prompt_completion_logprobs,
)
from gateway.api.validation import GenerationRequest
from gateway.text.tokenizer import ModelTokenizer
from gateway.text.tool_parser import ToolCall, ToolCallParser


@dataclass(slots=True)
class Piece:
    """One event's share of a choice: thinking, text, newly completed calls, logprobs, finish_reason."""

    text: str
    calls: list[ToolCall] = field(default_factory=list)
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    first_call_index: int = 0  # index (among the choice's calls) of calls[0]
    reasoning: str = ""

    @property
    def empty(self) -> bool:
        return not (self.text or self.reasoning or self.calls or self.logprobs or self.finish_reason)


class ChoiceOutput:
    """One choice's presentation state (see the module docstring)."""

    def __init__(self, req: GenerationRequest, tokenizer: ModelTokenizer) -> None:
        self.req = req
        self.tok = tokenizer
        self.names: TokenNames = TokenIdNames() if req.tokens_as_ids else tokenizer
        self.parser = ToolCallParser(req.tools.constrained) if req.tools.active else None
        self.text = ""  # everything shown as content/text
        self.reasoning = ""  # the thinking, apart (chat with a reasoning parser)
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.finish_reason: str | None = None
        self.echo_pending = req.echo

    @property
    def calls(self) -> list[ToolCall]:
        return self.parser.calls if self.parser is not None else []

    def feed(self, ev: ChoiceEvent, prompt_logprobs: list[TokenLogprob | None] | None) -> Piece:
        """The piece of output this event adds."""
        before = len(self.calls)
        text, _ = self.parser.feed(ev.text) if self.parser is not None else (ev.text, [])
        if ev.ended and self.parser is not None:
            text += self.parser.finish()[0]
        reason = None
        if ev.ended:
            if self.finish_reason is not None:
                raise RuntimeError(f"choice {ev.index} ended twice")
            reason = client_finish_reason(ev.engine_reason, ev.stopped_here, bool(self.calls))
        echo, echo_lps = self._echo(prompt_logprobs)
        logprobs = self._logprobs(ev.token_ids, ev.logprobs, len(self.text) + len(echo), echo_lps)
        self.text += echo + text
        self.reasoning += ev.reasoning
        self.token_ids.extend(ev.token_ids)
        self.logprobs.extend(ev.logprobs)
        self.finish_reason = reason or self.finish_reason  # set once, on the choice's last event
        return Piece(echo + text, self.calls[before:], logprobs, reason, before, ev.reasoning)

    def whole_logprobs(self, prompt_logprobs: list[TokenLogprob | None] | None) -> dict[str, Any] | None:
        """Logprobs of the whole choice (non-streaming), echoed prompt first."""
        echo_lps = None
        if self.req.echo and self.req.top_logprobs is not None:
            echo_lps = prompt_completion_logprobs(self.names, self.req.prompt_token_ids, prompt_logprobs,
                                                  self.req.top_logprobs)
        start = len(self.prompt_text()) if self.req.echo else 0
        return self._logprobs(self.token_ids, self.logprobs, start, echo_lps)

    def prompt_text(self) -> str:
        prompt = self.req.prompt
        return prompt if isinstance(prompt, str) else self.tok.decode(self.req.prompt_token_ids)

    def _echo(self, prompt_logprobs: list[TokenLogprob | None] | None) -> tuple[str, dict[str, Any] | None]:
        if not self.echo_pending:
            return "", None
        self.echo_pending = False
        lps = None
        if self.req.top_logprobs is not None:
            lps = prompt_completion_logprobs(self.names, self.req.prompt_token_ids, prompt_logprobs,
                                             self.req.top_logprobs)
        return self.prompt_text(), lps

    def _logprobs(self, ids: list[int], lps: list[TokenLogprob], text_offset: int,
                  echo_lps: dict[str, Any] | None) -> dict[str, Any] | None:
        req = self.req
        if req.top_logprobs is None:
            return None
        if req.kind is Endpoint.CHAT:
            return chat_logprobs(self.names, ids, lps, req.top_logprobs)
        out = completion_logprobs(self.names, ids, lps, req.top_logprobs, text_offset)
        if echo_lps is None:
            return out
        return {key: echo_lps[key] + out[key] for key in out}
