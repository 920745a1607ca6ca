"""Per-request output collector: the listener feeds it, the HTTP handler drains it.

`feed()` never blocks: it merges new tokens into pending deltas and sets an event, so a
slow client never holds up the listener. Duplicated tokens (an engine resuming a dead
engine's request) are dropped by token index; a hole in `seq` or in token offsets ends the
request with an error instead of silently losing text."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from common.protocol import ErrorInfo, OutputGap, OutputMessage, TokenLogprob, Usage, num_repeated


@dataclass(slots=True)
class ChoiceDelta:
    """New tokens of one choice since the last drain."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass(slots=True)
class Update:
    """Everything that arrived since the last drain."""

    choices: dict[int, ChoiceDelta]
    usage: Usage | None = None
    error: ErrorInfo | None = None
    done: bool = False
    prompt_logprobs: list[TokenLogprob | None] | None = None  # once, with the first update that has them
    engine: str | None = None  # the engine serving it, as the latest message naming one said (None: none did)
    embedding: bytes | None = None  # an embedding request's vector (little-endian float32), once it arrived


class RequestCollector:
    """Merges the output messages of one request."""

    def __init__(self, request_id: str, n: int, model: str = "", stream: str = "") -> None:
        self.request_id = request_id
        self.n = n
        self.model = model
        self.stream = stream  # the request stream it was added to (shared or an engine's routed one)
        self.routed_engine: str | None = None  # the engine routing chose (its load at this gateway)
        self.entry_id = ""  # of the request-stream entry, once submitted
        self.next_seq = 0
        self.received: dict[int, int] = {}
        self.finished: set[int] = set()
        self._pending: dict[int, ChoiceDelta] = {}
        self._usage: Usage | None = None
        self._error: ErrorInfo | None = None
        self._prompt_logprobs: list[TokenLogprob | None] | None = None
        self._prompt_logprobs_seen = False  # a resuming engine sends them again: keep the first
        self._embedding: bytes | None = None
        self.engine: str | None = None  # the latest engine that named itself (older engines do not: None)
        self._event = asyncio.Event()
        self.last_output = time.monotonic()  # when a message last arrived (the watchdog's clock)

    @property
    def done(self) -> bool:
        return self._error is not None or len(self.finished) >= self.n

    def feed(self, out: OutputMessage) -> None:
        """Merge one message (called by the listener; never blocks)."""
        if self.done:
            return
        self.last_output = time.monotonic()
        if out.seq > self.next_seq:
            self.fail(ErrorInfo(f"lost engine output (expected message {self.next_seq}, got {out.seq})",
                                "server_error", "output_gap"))
            return
        self.next_seq = max(self.next_seq, out.seq + 1)
        if out.engine is not None:  # an engine names itself on its first message for a request
            self.engine = out.engine
        for seq_out in out.outputs:
            if seq_out.index in self.finished or not 0 <= seq_out.index < self.n:
                continue
            have = self.received.get(seq_out.index, 0)
            try:
                skip = num_repeated(have, seq_out.offset)
            except OutputGap:
                self.fail(ErrorInfo(f"lost engine output (choice {seq_out.index} token {have})",
                                    "server_error", "output_gap"))
                return
            delta = self._pending.setdefault(seq_out.index, ChoiceDelta())
            new_ids = seq_out.token_ids[skip:]
            delta.token_ids.extend(new_ids)
            if seq_out.logprobs is not None:
                delta.logprobs.extend(seq_out.logprobs[skip:])
            self.received[seq_out.index] = have + len(new_ids)
            if seq_out.finish_reason is not None:
                delta.finish_reason = seq_out.finish_reason
                self.finished.add(seq_out.index)
        if out.prompt_logprobs is not None and not self._prompt_logprobs_seen:
            self._prompt_logprobs, self._prompt_logprobs_seen = out.prompt_logprobs, True
        if out.embedding is not None:
            self._embedding = out.embedding
        if out.usage is not None:
            self._usage = out.usage
        if out.error is not None:
            self._error = out.error
        self._event.set()

    def fail(self, error: ErrorInfo) -> None:
        """End the request with an error (gap, Redis connection lost, timeout)."""
        if self._error is None:
            self._error = error
        self._event.set()

    async def next_update(self, timeout: float) -> Update | None:
        """Wait up to `timeout` seconds; None when nothing arrived (an idle tick)."""
        if not self._event.is_set():
            try:
                await asyncio.wait_for(self._event.wait(), timeout)
            except asyncio.TimeoutError:
                return None
        self._event.clear()
        pending, self._pending = self._pending, {}
        prompt_logprobs, self._prompt_logprobs = self._prompt_logprobs, None
        return Update(pending, self._usage, self._error, self.done, prompt_logprobs, self.engine, self._embedding)
