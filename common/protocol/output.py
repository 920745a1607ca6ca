"""Engine → gateway messages: each step's new tokens per request (one entry per step per gateway
on the gateway's output stream), and the progress checkpoints a resuming engine folds back.

Token de-duplication: each `SeqOutput` says at which generated-token index (`offset`) its
`token_ids` start, so a receiver drops tokens it already has (an engine resuming a dead
engine's request may repeat some) and detects holes."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from common.protocol.fields import (
    INT32_MAX,
    MAX_LIST,
    PROTOCOL_VERSION,
    ProtocolError,
    decoding,
    int_list,
    integer,
    is_int,
    is_number,
    items,
    mapping,
    message_map,
    optional_text,
    pack,
    text,
    unpack,
)

FINISH_REASONS = ("stop", "length", "abort", "beam", "tool_calls", "error")


class OutputGap(ProtocolError):
    """Tokens that start past what the receiver holds: some output was lost in between."""


def num_repeated(have: int, offset: int) -> int:
    """How many leading tokens of a `SeqOutput` starting at generated-token index `offset` a
    receiver holding `have` tokens already has (and must drop). Raises OutputGap on a hole."""
    if offset > have:
        raise OutputGap(f"tokens start at index {offset} but only {have} arrived before")
    return have - offset


@dataclass(slots=True)
class TokenLogprob:
    """Logprob of one sampled token and its top alternatives as (token_id, logprob) pairs."""

    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)

    def to_obj(self) -> list[Any]:
        return [self.logprob, [[int(t), float(p)] for t, p in self.top]]

    @classmethod
    def from_obj(cls, obj: Any) -> TokenLogprob:
        if not isinstance(obj, (list, tuple)) or len(obj) != 2 or not isinstance(obj[1], (list, tuple)):
            raise ProtocolError("logprob: expected [logprob, [[token, logprob], ...]]")
        logprob, top = obj
        pairs = [pair for pair in top if isinstance(pair, (list, tuple)) and len(pair) == 2]
        if not _is_logprob(logprob) or len(pairs) != len(top) or not all(
                is_int(t) and 0 <= t <= INT32_MAX and _is_logprob(p) for t, p in pairs):
            raise ProtocolError("logprob: bad values")
        return cls(float(logprob), [(int(t), float(p)) for t, p in pairs])


def _is_logprob(value: Any) -> bool:
    return is_number(value) or value == float("-inf")


@dataclass(slots=True, kw_only=True)
class SeqOutput:
    """New tokens of one choice (`index`), starting at generated-token index `offset`."""

    index: int
    token_ids: list[int]
    offset: int = 0
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None

    def to_obj(self) -> dict[str, Any]:
        obj: dict[str, Any] = {"index": self.index, "offset": self.offset, "token_ids": list(self.token_ids),
                               "finish_reason": self.finish_reason}
        if self.logprobs is not None:
            obj["logprobs"] = [lp.to_obj() for lp in self.logprobs]
        return obj

    @classmethod
    def from_obj(cls, obj: Any) -> SeqOutput:
        what = "output choice"
        obj = message_map(obj, what)
        logprobs = obj.get("logprobs")
        reason = optional_text(obj, "finish_reason", what)
        if reason is not None and reason not in FINISH_REASONS:
            raise ProtocolError(f"{what}: unknown finish_reason {reason[:40]!r}")
        return cls(
            index=integer(obj, "index", what, hi=1 << 16), token_ids=int_list(obj, "token_ids", what),
            offset=integer(obj, "offset", what, hi=INT32_MAX, default=0), finish_reason=reason,
            logprobs=None if logprobs is None else [TokenLogprob.from_obj(lp) for lp in items(obj, "logprobs", what)],
        )

    def without_logprobs(self) -> SeqOutput:
        return dataclasses.replace(self, logprobs=None)


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts of a finished request; `cached_tokens` of the prompt came from the prefix cache."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class ErrorInfo:
    """An engine-side failure, mapped by the gateway to an OpenAI error body; `code` says what
    happened (`context_length_exceeded`, `invalid_token_id`, `engine_step_failed`, `timeout`,
    `request_dead_lettered`, ...)."""

    message: str
    type: str = "server_error"
    code: str | None = None


@dataclass(slots=True, kw_only=True)
class OutputMessage:
    """One request's part of an output batch. `usage` comes with the message that finishes
    the last choice; `error` ends the request. `prompt_logprobs` (asked for with
    `SamplingParams.prompt_logprobs`) comes once, with the first message: one entry per prompt
    token, None for the first (nothing predicts it). `engine`: the id of the engine that wrote
    it, on the first message each engine writes for a request (a request resumed elsewhere after
    a failover or drain: the new engine's first names it); optional on the wire (older engines
    omit it, older gateways ignore it). `embedding`: an embedding request's pooled vector,
    little-endian float32 bytes, on the message that finishes it (instead of tokens)."""

    id: str
    seq: int
    outputs: list[SeqOutput] = field(default_factory=list)
    usage: Usage | None = None
    error: ErrorInfo | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    engine: str | None = None
    embedding: bytes | None = None

    def to_obj(self) -> dict[str, Any]:
        obj: dict[str, Any] = {"v": PROTOCOL_VERSION, "id": self.id, "seq": self.seq,
                               "outputs": [o.to_obj() for o in self.outputs]}
        if self.usage is not None:
            obj["usage"] = {"prompt_tokens": self.usage.prompt_tokens,
                            "completion_tokens": self.usage.completion_tokens,
                            "cached_tokens": self.usage.cached_tokens}
        if self.error is not None:
            obj["error"] = {"message": self.error.message, "type": self.error.type, "code": self.error.code}
        if self.prompt_logprobs is not None:
            obj["prompt_logprobs"] = [None if lp is None else lp.to_obj() for lp in self.prompt_logprobs]
        if self.engine is not None:
            obj["engine"] = self.engine
        if self.embedding is not None:
            obj["embedding"] = bytes(self.embedding)
        return obj

    @classmethod
    def from_obj(cls, obj: Any) -> OutputMessage:
        """Raises only ProtocolError."""
        what = "output"
        obj = message_map(obj, what)
        with decoding(what):
            usage, error, prompt = obj.get("usage"), obj.get("error"), obj.get("prompt_logprobs")
            return cls(
                id=text(obj, "id", what), seq=integer(obj, "seq", what, hi=INT32_MAX),
                outputs=[SeqOutput.from_obj(o) for o in items(obj, "outputs", what, default=[])],
                usage=None if usage is None else _usage(mapping(obj, "usage", what)),
                error=None if error is None else _error(mapping(obj, "error", what)),
                prompt_logprobs=None if prompt is None else [
                    None if lp is None else TokenLogprob.from_obj(lp) for lp in items(obj, "prompt_logprobs", what)],
                engine=optional_text(obj, "engine", what),
                embedding=_embedding(obj.get("embedding")),
            )

    def checkpoint(self) -> OutputMessage:
        """What a resuming engine needs of this message: tokens, offsets, finish state, usage
        and error, without logprobs, prompt logprobs (which can be most of its bytes) or the
        engine id."""
        return OutputMessage(id=self.id, seq=self.seq, outputs=[o.without_logprobs() for o in self.outputs],
                             usage=self.usage, error=self.error)

    def encode(self) -> bytes:
        """A single output (used for progress checkpoints)."""
        return pack(self.to_obj())

    @classmethod
    def decode(cls, data: bytes) -> OutputMessage:
        return cls.from_obj(unpack(data))


def _embedding(value: Any) -> bytes | None:
    if value is None:
        return None
    if not isinstance(value, bytes) or len(value) % 4 or len(value) > 4 * MAX_LIST:
        raise ProtocolError("output: embedding must be float32 bytes")
    return value


def _usage(obj: dict[str, Any]) -> Usage:
    what = "usage"
    return Usage(integer(obj, "prompt_tokens", what, hi=INT32_MAX), integer(obj, "completion_tokens", what,
                 hi=INT32_MAX), integer(obj, "cached_tokens", what, hi=INT32_MAX, default=0))


def _error(obj: dict[str, Any]) -> ErrorInfo:
    what = "error"
    return ErrorInfo(text(obj, "message", what), text(obj, "type", what, default="server_error"),
                     optional_text(obj, "code", what))


def encode_outputs(outputs: list[OutputMessage]) -> bytes:
    """One output-stream entry: a msgpack list of outputs for requests of one gateway."""
    return pack([o.to_obj() for o in outputs])


def decode_outputs(data: bytes) -> list[OutputMessage]:
    """Raises only ProtocolError."""
    obj = unpack(data)
    if not isinstance(obj, list):
        raise ProtocolError(f"output batch: expected a list, got {type(obj).__name__}")
    return [OutputMessage.from_obj(o) for o in obj]


@dataclass(slots=True)
class Progress:
    """What a client has been sent for one request, folded from its progress list (or, for an
    engine's own checkpoint log, from the messages it wrote: then each choice's tokens start at
    the offset of its first message, `starts`)."""

    last_seq: int = -1
    token_ids: dict[int, list[int]] = field(default_factory=dict)
    finished: dict[int, str] = field(default_factory=dict)
    starts: dict[int, int] = field(default_factory=dict)  # a choice absent here starts at token 0

    def fold(self, out: OutputMessage, open_start: bool = False) -> None:
        """Add one message's tokens (de-duplicated by offset; OutputGap on a hole). With
        `open_start`, a choice seen for the first time starts at its message's offset."""
        self.last_seq = max(self.last_seq, out.seq)
        for seq_out in out.outputs:
            if open_start and seq_out.index not in self.token_ids:
                self.starts[seq_out.index] = seq_out.offset
            tokens = self.token_ids.setdefault(seq_out.index, [])
            have = self.starts.get(seq_out.index, 0) + len(tokens)
            tokens.extend(seq_out.token_ids[num_repeated(have, seq_out.offset):])
            if seq_out.finish_reason is not None:
                self.finished[seq_out.index] = seq_out.finish_reason

    def snapshot(self, request_id: str) -> OutputMessage:
        """One checkpoint entry that folds to the same progress as every message folded here."""
        return OutputMessage(id=request_id, seq=self.last_seq, outputs=[
            SeqOutput(index=index, token_ids=list(tokens), offset=self.starts.get(index, 0),
                      finish_reason=self.finished.get(index))
            for index, tokens in sorted(self.token_ids.items())])


def merge_progress(entries: list[bytes]) -> Progress:
    """Fold ``LRANGE {prefix}:progress:<id> 0 -1`` into tokens per choice (de-duplicated by
    offset). Raises only ProtocolError (OutputGap on a hole)."""
    progress = Progress()
    for raw in entries:
        progress.fold(OutputMessage.decode(raw))
    return progress
