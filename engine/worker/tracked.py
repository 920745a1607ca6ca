"""Requests an engine worker is serving: wire bookkeeping (message `seq`, token offsets),
engine deltas → wire messages, and how a claimed request resumes from its progress."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from common.protocol import (
    EngineRequest,
    ErrorInfo,
    OutputMessage,
    Progress,
    SeqOutput,
    TokenLogprob,
    Usage,
)
from engine.outputs import RequestOutput
from engine.worker.engine_thread import AddJob


@dataclass(slots=True)
class Tracked:
    """One in-flight request: where it came from and what its client has been sent."""

    request: EngineRequest
    entry_id: str
    seq: int = 0
    sent: dict[int, int] = field(default_factory=dict)
    started: float = field(default_factory=time.time)
    first_token_at: float | None = None
    resumed: bool = False
    stream: str = ""  # the request stream its entry is on (empty: the model's shared one)
    engine: str = ""  # this engine's id, named on the first message it writes (empty: never named)
    named: bool = False  # a message naming `engine` was written

    @property
    def request_id(self) -> str:
        return self.request.id

    @property
    def gateway(self) -> str:
        return self.request.gateway

    def next_seq(self) -> int:
        seq, self.seq = self.seq, self.seq + 1
        return seq

    def engine_id(self) -> str | None:
        """What the next message carries as `engine`: this engine's id on the first message it
        writes for the request (after a takeover or hand-back, the new engine's first), None
        (the field left out) on the rest, whose receiver already knows it: a one-token message
        stays 110 bytes instead of 130."""
        if self.named or not self.engine:
            return None
        self.named = True
        return self.engine


def _token_logprob(entry: dict[str, Any]) -> TokenLogprob:
    return TokenLogprob(float(entry["logprob"]), [(int(t), float(p)) for t, p in entry.get("top_logprobs") or []])


def _logprobs(entries: list[dict[str, Any]] | None) -> list[TokenLogprob] | None:
    return None if entries is None else [_token_logprob(e) for e in entries]


def to_wire(tracked: Tracked, out: RequestOutput) -> OutputMessage:
    """The wire message for one engine delta; advances `seq` and the per-choice offsets."""
    outputs = []
    for choice in out.outputs:
        offset = tracked.sent.get(choice.index, 0)
        outputs.append(SeqOutput(index=choice.index, token_ids=list(choice.token_ids), offset=offset,
                                 finish_reason=choice.finish_reason,
                                 logprobs=_logprobs(choice.logprobs)))
        tracked.sent[choice.index] = offset + len(choice.token_ids)
    if tracked.first_token_at is None and any(o.token_ids for o in outputs):
        tracked.first_token_at = time.time()
    usage = Usage(out.num_prompt_tokens, out.num_generated_tokens, out.num_cached_tokens) if out.finished else None
    error = None if out.error is None else ErrorInfo(out.error, "invalid_request_error",
                                                     out.error_code or "engine_error")
    prompt = None if out.prompt_logprobs is None else [
        None if e is None else _token_logprob(e) for e in out.prompt_logprobs]
    return OutputMessage(id=tracked.request_id, seq=tracked.next_seq(), outputs=outputs, usage=usage, error=error,
                         prompt_logprobs=prompt, engine=tracked.engine_id(),
                         embedding=out.embedding)


def error_output(tracked: Tracked, message: str, type_: str = "invalid_request_error",
                 code: str | None = None) -> OutputMessage:
    """A message that ends the request with an error."""
    return OutputMessage(id=tracked.request_id, seq=tracked.next_seq(), outputs=[], usage=None,
                         error=ErrorInfo(message, type_, code),
                         engine=tracked.engine_id())


def resume(request: EngineRequest, entry_id: str, progress: Progress,
           stream: str = "", engine: str = "") -> tuple[Tracked, AddJob] | None:
    """Bookkeeping and engine job for a claimed request (its entry on `stream`, served by engine
    `engine`); None when its client already has it all."""
    if progress.last_seq >= 0 and len(progress.finished) >= request.params.n:
        return None
    tracked = Tracked(request, entry_id, seq=progress.last_seq + 1, resumed=progress.last_seq >= 0, stream=stream,
                      engine=engine)
    generated: list[int] = []
    if request.params.resumes_in_place:
        generated = list(progress.token_ids.get(0, []))
        tracked.sent = {0: len(generated)}
        if generated:
            tracked.first_token_at = tracked.started
    return tracked, AddJob(request_id=request.id, prompt_token_ids=request.prompt_token_ids, params=request.params,
                           generated=generated, lora_name=request.lora_name, pooling=request.pooling)
