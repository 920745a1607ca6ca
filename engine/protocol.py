"""Wire protocol between gateways and engines: msgpack messages and Redis key names.

The gateway imports this module, `engine.sampling_params` and `engine.log` from `engine`
(none of them imports torch); nothing here pickles. Every message carries `v`
(PROTOCOL_VERSION); a message with another version is rejected with `ProtocolError`.

Flow (protocol version 2; see `docs/stream-layout.md` for the layout and the migration from 1):
- gateway ``XADD {prefix}:requests:<model> * m <EngineRequest.encode()>``: one stream and one
  consumer group ``engines`` per served model name, so a request only reaches engines of its
  model and only they take over each other's entries. The gateway's submit script refuses
  the XADD past the model's queue bound (429) and when Redis lost its data (epoch changed).
- engine ``XADD {prefix}:out:<gateway_id> MAXLEN ~ N * m <encode_outputs([...])>``: one entry
  per step per gateway on the gateway's output *stream*, read by id, so output written while
  a gateway reconnects is read afterwards, never lost; ``seq`` counts messages per request.
- gateway ``PUBLISH {prefix}:abort <AbortMessage.encode()>`` when a client leaves or a stop
  string matched.
- gateway ``SET {prefix}:gateway:<gateway_id> PX ttl``: liveness; engines drop the requests
  of a gateway whose key is gone.
- ``{prefix}:epoch``: a random token set once per Redis dataset; a changed or missing token
  means Redis restarted without persistence and every in-flight request is lost.
- engine ``HSET {prefix}:engine:<engine_id>`` (EngineHeartbeat.to_hash()) with a TTL.
- engine ``RPUSH {prefix}:progress:<request_id> <OutputMessage.encode()>`` in the same
  MULTI/EXEC as each output, with a TTL; `merge_progress` folds the list back.
- ``{prefix}:dead:<model>``: dead-letter stream of requests taken over too many times.

Token de-duplication: each `SeqOutput` says at which generated-token index (`offset`) its
`token_ids` start, so a receiver drops tokens it already has (an engine resuming a dead
engine's request may repeat some) and detects holes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import msgpack

PROTOCOL_VERSION = 2
DEFAULT_PREFIX = "ps"
CONSUMER_GROUP = "engines"
REQUEST_FIELD = "m"


class ProtocolError(ValueError):
    """A wire message that cannot be decoded (wrong version, missing or mistyped field)."""


class OutputGap(ProtocolError):
    """Tokens that start past what the receiver holds: some output was lost in between."""


def num_repeated(have: int, offset: int) -> int:
    """How many leading tokens of a `SeqOutput` starting at generated-token index `offset` a
    receiver holding `have` tokens already has (and must drop). Raises OutputGap on a hole."""
    if offset > have:
        raise OutputGap(f"tokens start at index {offset} but only {have} arrived before")
    return have - offset


@dataclass(frozen=True, slots=True)
class Keys:
    """Redis stream, channel and key names derived from one prefix."""

    prefix: str = DEFAULT_PREFIX

    def requests(self, model: str) -> str:
        """The request stream of one served model name."""
        return f"{self.prefix}:requests:{model}"

    def dead(self, model: str) -> str:
        """Dead-letter stream: requests of `model` that were taken over too many times."""
        return f"{self.prefix}:dead:{model}"

    @property
    def epoch(self) -> str:
        return f"{self.prefix}:epoch"

    @property
    def group(self) -> str:
        return CONSUMER_GROUP

    @property
    def abort(self) -> str:
        return f"{self.prefix}:abort"

    @property
    def engine_pattern(self) -> str:
        """SCAN pattern matching every engine heartbeat hash."""
        return f"{self.prefix}:engine:*"

    def out(self, gateway_id: str) -> str:
        """The gateway's output stream (read by id)."""
        return f"{self.prefix}:out:{gateway_id}"

    def gateway(self, gateway_id: str) -> str:
        """The gateway's liveness key (with a TTL)."""
        return f"{self.prefix}:gateway:{gateway_id}"

    def engine(self, engine_id: str) -> str:
        return f"{self.prefix}:engine:{engine_id}"

    def progress(self, request_id: str) -> str:
        return f"{self.prefix}:progress:{request_id}"


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _unpack(data: bytes) -> Any:
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise ProtocolError(f"not a msgpack message: {exc}") from exc


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _check_version(obj: Any, what: str) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise ProtocolError(f"{what}: expected a map, got {type(obj).__name__}")
    if obj.get("v", PROTOCOL_VERSION) != PROTOCOL_VERSION:
        raise ProtocolError(f"{what}: protocol version {obj.get('v')!r}, expected {PROTOCOL_VERSION}")
    return obj


@dataclass(slots=True)
class EngineRequest:
    """One generation request, XADDed to its model's request stream under field ``m``. `params`
    is `engine.sampling_params.SamplingParams.to_dict()`: one type from gateway to engine.
    `handoffs` counts how often a draining engine put the request back on the stream (the
    reader then resumes it from its progress checkpoint). `epoch` is the dataset token the
    gateway saw when it submitted: an engine reading a request of a newer epoch knows Redis
    lost its data and drops what it was running before admitting it."""

    id: str
    gateway: str
    model: str
    prompt_token_ids: list[int]
    params: dict[str, Any]
    arrival: float
    deadline: float | None = None
    handoffs: int = 0
    epoch: str = ""

    def encode(self) -> bytes:
        return _pack({
            "v": PROTOCOL_VERSION, "id": self.id, "gateway": self.gateway, "model": self.model,
            "prompt_token_ids": list(self.prompt_token_ids), "params": self.params,
            "arrival": self.arrival, "deadline": self.deadline, "handoffs": self.handoffs,
            "epoch": self.epoch,
        })

    @classmethod
    def decode(cls, data: bytes) -> EngineRequest:
        obj = _check_version(_unpack(data), "request")
        try:
            return cls(
                id=str(obj["id"]), gateway=str(obj["gateway"]), model=str(obj["model"]),
                prompt_token_ids=[int(t) for t in obj["prompt_token_ids"]], params=dict(obj["params"]),
                arrival=float(obj["arrival"]), deadline=None if obj.get("deadline") is None
                else float(obj["deadline"]), handoffs=int(obj.get("handoffs", 0)),
                epoch=str(obj.get("epoch", "")),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(f"request: bad field: {exc!r}") from exc


@dataclass(slots=True)
class TokenLogprob:
    """Logprob of one sampled token and its top alternatives as (token_id, logprob) pairs."""

    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)

    def to_obj(self) -> list[Any]:
        return [self.logprob, [[int(t), float(p)] for t, p in self.top]]

    @classmethod
    def from_obj(cls, obj: Any) -> TokenLogprob:
        logprob, top = obj
        return cls(float(logprob), [(int(t), float(p)) for t, p in top])


@dataclass(slots=True)
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
    def from_obj(cls, obj: dict[str, Any]) -> SeqOutput:
        logprobs = obj.get("logprobs")
        return cls(
            index=int(obj["index"]), token_ids=[int(t) for t in obj["token_ids"]],
            offset=int(obj.get("offset", 0)), finish_reason=obj.get("finish_reason"),
            logprobs=None if logprobs is None else [TokenLogprob.from_obj(lp) for lp in logprobs],
        )


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts of a finished request; `cached_tokens` of the prompt came from the prefix cache."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class ErrorInfo:
    """An engine-side failure, mapped by the gateway to an OpenAI error body."""

    message: str
    type: str = "server_error"
    code: str | None = None


@dataclass(slots=True)
class OutputMessage:
    """One request's part of an output batch. `usage` comes with the message that finishes
    the last choice; `error` ends the request. `prompt_logprobs` (asked for with
    `SamplingParams.prompt_logprobs`) comes once, with the first message: one entry per prompt
    token, None for the first (nothing predicts it)."""

    id: str
    seq: int
    outputs: list[SeqOutput] = field(default_factory=list)
    usage: Usage | None = None
    error: ErrorInfo | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None

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
        return obj

    @classmethod
    def from_obj(cls, obj: Any) -> OutputMessage:
        obj = _check_version(obj, "output")
        try:
            usage, error, prompt = obj.get("usage"), obj.get("error"), obj.get("prompt_logprobs")
            return cls(
                id=str(obj["id"]), seq=int(obj["seq"]),
                outputs=[SeqOutput.from_obj(o) for o in obj.get("outputs", [])],
                usage=None if usage is None else Usage(int(usage["prompt_tokens"]),
                                                       int(usage["completion_tokens"]),
                                                       int(usage.get("cached_tokens", 0))),
                error=None if error is None else ErrorInfo(str(error["message"]),
                                                           str(error.get("type", "server_error")),
                                                           error.get("code")),
                prompt_logprobs=None if prompt is None else [
                    None if lp is None else TokenLogprob.from_obj(lp) for lp in prompt],
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(f"output: bad field: {exc!r}") from exc

    def encode(self) -> bytes:
        """A single output (used for progress checkpoints)."""
        return _pack(self.to_obj())

    @classmethod
    def decode(cls, data: bytes) -> OutputMessage:
        return cls.from_obj(_unpack(data))


def encode_outputs(outputs: list[OutputMessage]) -> bytes:
    """One pub/sub message: a msgpack list of outputs for requests of one gateway."""
    return _pack([o.to_obj() for o in outputs])


def decode_outputs(data: bytes) -> list[OutputMessage]:
    obj = _unpack(data)
    if not isinstance(obj, list):
        raise ProtocolError(f"output batch: expected a list, got {type(obj).__name__}")
    return [OutputMessage.from_obj(o) for o in obj]


@dataclass(slots=True)
class AbortMessage:
    """Request ids whose generation should stop (client left, stop string matched)."""

    ids: list[str]

    def encode(self) -> bytes:
        return _pack({"v": PROTOCOL_VERSION, "ids": list(self.ids)})

    @classmethod
    def decode(cls, data: bytes) -> AbortMessage:
        obj = _check_version(_unpack(data), "abort")
        try:
            return cls(ids=[str(i) for i in obj["ids"]])
        except (KeyError, TypeError) as exc:
            raise ProtocolError(f"abort: bad field: {exc!r}") from exc


@dataclass(slots=True)
class Progress:
    """What a client has been sent for one request, folded from its progress list."""

    last_seq: int = -1
    token_ids: dict[int, list[int]] = field(default_factory=dict)
    finished: dict[int, str] = field(default_factory=dict)


def merge_progress(entries: list[bytes]) -> Progress:
    """Fold ``LRANGE {prefix}:progress:<id> 0 -1`` into tokens per choice (de-duplicated by offset)."""
    progress = Progress()
    for raw in entries:
        out = OutputMessage.decode(raw)
        progress.last_seq = max(progress.last_seq, out.seq)
        for seq_out in out.outputs:
            tokens = progress.token_ids.setdefault(seq_out.index, [])
            tokens.extend(seq_out.token_ids[num_repeated(len(tokens), seq_out.offset):])
            if seq_out.finish_reason is not None:
                progress.finished[seq_out.index] = seq_out.finish_reason
    return progress


@dataclass(slots=True)
class EngineHeartbeat:
    """Contents of the ``{prefix}:engine:<id>`` hash. `model` is the served model name,
    `tokenizer` the directory a gateway loads the tokenizer and chat template from. `pool` is
    the run-length snapshot of the device block pool (`engine.kv.block_stats.pool_snapshot`:
    ``[[state, run_length], ...]``), stored as ``"state:run,state:run"`` in field ``pool``.
    `tables` are the block tables of running and swapped sequences
    (`engine.kv.block_stats.block_tables`), JSON in field ``tables``. `config_hash` and
    `vocab_size` identify the weights and tokenizer: engines announcing one name must agree,
    or failover between them would change answers. `draining` is set after SIGTERM."""

    engine_id: str
    model: str
    tokenizer: str
    max_model_len: int
    time: float
    stats: dict[str, float] = field(default_factory=dict)
    pool: list[list[int]] = field(default_factory=list)
    tables: list[dict[str, Any]] = field(default_factory=list)
    config_hash: str = ""
    vocab_size: int = 0
    draining: bool = False

    def identity(self) -> tuple[str, int, int]:
        """What must be equal between engines serving one model name."""
        return self.config_hash, self.vocab_size, self.max_model_len

    def to_hash(self) -> dict[str, str]:
        fields = {"engine_id": self.engine_id, "model": self.model, "tokenizer": self.tokenizer,
                  "max_model_len": str(self.max_model_len), "time": repr(self.time),
                  "config_hash": self.config_hash, "vocab_size": str(self.vocab_size),
                  "draining": "1" if self.draining else "0"}
        fields.update({f"stat:{k}": repr(float(v)) for k, v in self.stats.items()})
        if self.pool:
            fields["pool"] = ",".join(f"{state}:{run}" for state, run in self.pool)
        if self.tables:
            fields["tables"] = json.dumps(self.tables, separators=(",", ":"))
        return fields

    @classmethod
    def from_hash(cls, data: dict[Any, Any]) -> EngineHeartbeat:
        text = {_text(k): _text(v) for k, v in data.items()}
        try:
            return cls(
                engine_id=text["engine_id"], model=text["model"], tokenizer=text.get("tokenizer", ""),
                max_model_len=int(text.get("max_model_len", "0")), time=float(text.get("time", "0")),
                stats={k[5:]: float(v) for k, v in text.items() if k.startswith("stat:")},
                pool=[[int(x) for x in run.split(":", 1)] for run in text.get("pool", "").split(",") if run],
                tables=list(json.loads(text.get("tables", "[]"))),
                config_hash=text.get("config_hash", ""), vocab_size=int(text.get("vocab_size", "0")),
                draining=text.get("draining", "0") == "1",
            )
        except (KeyError, ValueError, TypeError) as exc:
            raise ProtocolError(f"heartbeat: bad field: {exc!r}") from exc
