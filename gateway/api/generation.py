"""One request's generation as seen by a client: collector updates → per-choice text events.

Each choice runs its own incremental detokenizer, stop matcher (on the whole text, thinking
included, as vLLM's), reasoning parser (with one: the thinking goes to `reasoning`, apart) and
(with tools) call guard, which sees the answer only.
When every choice has finished here (a stop string, a repeated or one call too many) before
the engine said so, the engine side is aborted."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from common.protocol import ErrorInfo, TokenLogprob, Usage
from gateway.broker.broker import Broker
from gateway.broker.collector import ChoiceDelta, RequestCollector
from gateway.text.call_guard import CallGuard
from gateway.text.detokenize import IncrementalDetokenizer
from gateway.text.reasoning import ReasoningParser
from gateway.text.stop import StopMatcher
from gateway.text.tokenizer import ModelTokenizer


@dataclass(slots=True)
class ChoiceEvent:
    """New text of one choice. Its last event has `ended` set, with why: `engine_reason` (what
    the engine said, None when it had not finished) and `stopped_here` (a stop string or the
    call guard ended it in the gateway). `client_finish_reason` turns those into the one reason
    the client sees."""

    index: int
    text: str  # the answer (without a reasoning parser: all the text)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    ended: bool = False
    engine_reason: str | None = None
    stopped_here: bool = False
    reasoning: str = ""  # new thinking, split off by the request's reasoning parser


def client_finish_reason(engine_reason: str | None, stopped_here: bool, made_calls: bool) -> str:
    """The one finish reason a client sees for a choice: "stop" when a stop string or the call guard
    ended it here, else the engine's ("stop" at EOS or a stop token, "length"); a "stop" of an
    answer that made tool calls is "tool_calls"."""
    reason = "stop" if stopped_here else (engine_reason or "stop")
    return "tool_calls" if made_calls and reason == "stop" else reason


class GenerationError(Exception):
    """The engine side failed; carries the protocol's error info."""

    def __init__(self, info: ErrorInfo) -> None:
        super().__init__(info.message)
        self.info = info


class _Choice:
    def __init__(self, index: int, tokenizer: ModelTokenizer, stops: list[str], guard: CallGuard | None,
                 reasoner: ReasoningParser | None = None) -> None:
        self.index = index
        # a harmony parser reads the special tokens that mark its channels
        keep_special = reasoner is not None and reasoner.needs_special_tokens
        self.detok = IncrementalDetokenizer(
            (lambda ids: tokenizer.decode(ids, skip_special_tokens=False)) if keep_special else tokenizer.decode)
        self.stop = StopMatcher(stops)
        self.guard = guard
        self.reasoner = reasoner
        self.reasoning = ""  # thinking of the event being built
        self.num_tokens = 0
        self.ended = False

    @property
    def matched(self) -> bool:
        return self.stop.matched is not None or (self.guard is not None and self.guard.matched is not None)

    def advance(self, delta: ChoiceDelta) -> ChoiceEvent:
        self.num_tokens += len(delta.token_ids)
        text = self._feed(self.detok.add(delta.token_ids))
        if not self.matched and delta.finish_reason is not None:
            text += self._feed(self.detok.flush())
            text += "" if self.matched else self._end()
        self.ended = self.matched or delta.finish_reason is not None
        reasoning, self.reasoning = self.reasoning, ""
        return ChoiceEvent(self.index, text, delta.token_ids, delta.logprobs, self.ended,
                           delta.finish_reason, self.matched, reasoning)

    def _feed(self, text: str) -> str:
        """Text through the stop matcher, the reasoning parser, then the call guard (each gives
        back what it held once a stop string has ended the output)."""
        text = self._answer(self.stop.feed(text), self.stop.matched is not None)
        if self.guard is None:
            return text
        text = self.guard.feed(text)
        return text + (self.guard.flush() if self.stop.matched is not None else "")

    def _answer(self, text: str, final: bool) -> str:
        """The answer part of `text`; its thinking is kept in `self.reasoning`."""
        if self.reasoner is None:
            return text
        reasoning, answer = self.reasoner.feed(text)
        if final:
            more_reasoning, more_answer = self.reasoner.finish()
            reasoning, answer = reasoning + more_reasoning, answer + more_answer
        self.reasoning += reasoning
        return answer

    def _end(self) -> str:
        rest = self._answer(self.stop.flush(), True)
        return rest if self.guard is None else self.guard.feed(rest) + self.guard.flush()


class Generation:
    """Drives one submitted request; iterate `events()` until it ends."""

    def __init__(self, broker: Broker, collector: RequestCollector, tokenizer: ModelTokenizer,
                 stops: list[str], prompt_tokens: int, timeout_s: float, tick_s: float,
                 tool_calls: bool = False, max_calls: int | None = None,
                 reasoning: Callable[[], ReasoningParser] | None = None) -> None:
        """`tool_calls`: the output is read for calls; each choice then ends at a repeated call
        or past `max_calls` (`CallGuard`). `reasoning`: makes each choice's reasoning parser."""
        self.broker = broker
        self.collector = collector
        self.choices = [_Choice(i, tokenizer, stops, CallGuard(max_calls) if tool_calls else None,
                                None if reasoning is None else reasoning())
                        for i in range(collector.n)]
        self.prompt_tokens = prompt_tokens
        self.timeout_s = timeout_s
        self.tick_s = tick_s
        self.engine_usage: Usage | None = None
        self.first_token_at: float | None = None
        self.finished = False
        self.prompt_logprobs: list[TokenLogprob | None] | None = None  # when asked for: set before any event
        # the engine serving it, as of the latest update (None before any output, or from an
        # engine too old to name itself; after a failover or drain, the one it resumed on)
        self.engine: str | None = None

    @property
    def request_id(self) -> str:
        return self.collector.request_id

    @property
    def system_fingerprint(self) -> str | None:
        """OpenAI's `system_fingerprint` (the backend that answered): ``pagedserve-<engine id>``
        once an engine named itself, else None."""
        return None if self.engine is None else f"pagedserve-{self.engine}"

    @property
    def usage(self) -> Usage:
        completion = sum(c.num_tokens for c in self.choices)
        if self.engine_usage is not None:
            completion = max(completion, self.engine_usage.completion_tokens)
        cached = self.engine_usage.cached_tokens if self.engine_usage is not None else 0
        return Usage(self.prompt_tokens, completion, cached)

    async def events(self) -> AsyncIterator[ChoiceEvent | None]:
        """Yields choice events, and None on idle ticks (time for an SSE ping / disconnect check).
        Raises GenerationError on engine errors and timeouts."""
        deadline = time.monotonic() + self.timeout_s
        while not self.finished:
            update = await self.collector.next_update(min(self.tick_s, max(0.0, deadline - time.monotonic())))
            if update is None:
                if time.monotonic() >= deadline:
                    raise GenerationError(ErrorInfo("request timed out", "timeout", "timeout"))
                yield None
                continue
            self.engine_usage = update.usage or self.engine_usage
            self.engine = update.engine
            if update.prompt_logprobs is not None and self.prompt_logprobs is None:
                self.prompt_logprobs = update.prompt_logprobs
            for index, delta in sorted(update.choices.items()):
                choice = self.choices[index]
                if choice.ended:
                    continue
                if self.first_token_at is None and delta.token_ids:
                    self.first_token_at = time.monotonic()
                event = choice.advance(delta)
                if event.text or event.reasoning or event.ended or event.logprobs:
                    yield event
            if update.error is not None:
                raise GenerationError(update.error)
            if all(c.ended for c in self.choices):
                self.finished = True
                if not update.done:  # stopped here by a stop string: stop the engine too
                    await self.broker.abort([self.request_id], self.collector.model)

    async def close(self) -> None:
        """Release the collector; abort on the engine when the client left early."""
        self.broker.release(self.request_id)
        if not self.finished and not self.collector.done:
            await self.broker.abort([self.request_id], self.collector.model)
