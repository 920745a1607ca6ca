"""Gateway → engine messages: a generation request (XADDed to its model's stream) and an abort
(published on the abort channel)."""

from __future__ import annotations

from dataclasses import dataclass

from common.pooling_params import PoolingParamError, PoolingParams
from common.protocol.fields import (
    PROTOCOL_VERSION,
    ProtocolError,
    decoding,
    int_list,
    integer,
    items,
    mapping,
    message_map,
    number,
    optional_number,
    pack,
    text,
    unpack,
)
from common.sampling_params import ParamError, SamplingParams

MAX_ABORT_IDS = 10_000


@dataclass(slots=True, kw_only=True)
class EngineRequest:
    """One generation request, XADDed to its model's request stream under field ``m``; its
    `params` are decoded and validated (`SamplingParams`) on both sides. `handoffs` counts how
    often a draining engine put the request back on the stream (the reader then resumes it from
    its progress checkpoint). `epoch` is the dataset token the gateway saw when it submitted: an
    engine reading a request of a newer epoch knows Redis lost its data and drops what it was
    running before admitting it. `gateway_token` is the submitting gateway process's liveness
    token (the value of its ``{prefix}:gateway:<id>`` key): an engine stops the request at once
    when that key holds another token (the gateway restarted under the same id); empty: an older
    gateway, only the key's presence counts. `lora_name`: the LoRA adapter of `model` to run it
    with (empty: the base model). `pooling`: an embedding request (a pooling engine
    prefills the prompt and answers with its pooled vector instead of tokens); None: generation."""

    id: str
    gateway: str
    model: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: float
    deadline: float | None = None
    handoffs: int = 0
    epoch: str = ""
    gateway_token: str = ""
    lora_name: str = ""
    pooling: PoolingParams | None = None

    def encode(self) -> bytes:
        obj = {
            "v": PROTOCOL_VERSION, "id": self.id, "gateway": self.gateway, "model": self.model,
            "prompt_token_ids": list(self.prompt_token_ids), "params": self.params.to_dict(),
            "arrival": self.arrival, "deadline": self.deadline, "handoffs": self.handoffs,
            "epoch": self.epoch, "gateway_token": self.gateway_token, "lora_name": self.lora_name,
        }
        if self.pooling is not None:  # absent for generation: older engines read the message as before
            obj["pooling"] = self.pooling.to_dict()
        return pack(obj)

    @classmethod
    def decode(cls, data: bytes) -> EngineRequest:
        """Raises only ProtocolError, whatever `data` holds (the reader dead-letters it)."""
        obj = message_map(unpack(data), "request")
        what = "request"
        with decoding(what):
            request = cls(
                id=text(obj, "id", what), gateway=text(obj, "gateway", what), model=text(obj, "model", what),
                prompt_token_ids=int_list(obj, "prompt_token_ids", what),
                params=_params(mapping(obj, "params", what)),
                arrival=number(obj, "arrival", what), deadline=optional_number(obj, "deadline", what),
                handoffs=integer(obj, "handoffs", what, hi=1 << 20, default=0),
                epoch=text(obj, "epoch", what, default=""),
                gateway_token=text(obj, "gateway_token", what, default=""),
                lora_name=text(obj, "lora_name", what, default=""),
                pooling=None if obj.get("pooling") is None else _pooling(mapping(obj, "pooling", what)),
            )
        if not request.id:
            raise ProtocolError("request: empty id")
        return request


def _params(raw: dict[str, object]) -> SamplingParams:
    if not all(isinstance(key, str) for key in raw):
        raise ProtocolError("request: params keys must be strings")
    try:
        return SamplingParams.from_dict(raw)
    except ParamError as exc:
        raise ProtocolError(f"request: params.{exc.param}: {exc}") from exc


def _pooling(raw: dict[str, object]) -> PoolingParams:
    try:
        return PoolingParams.from_dict({str(k): v for k, v in raw.items()})
    except PoolingParamError as exc:
        raise ProtocolError(f"request: pooling.{exc.param}: {exc}") from exc


@dataclass(slots=True)
class AbortMessage:
    """Request ids whose generation should stop (client left, stop string matched). `model`,
    when set, scopes it: engines of other models ignore it."""

    ids: list[str]
    model: str = ""

    def encode(self) -> bytes:
        return pack({"v": PROTOCOL_VERSION, "ids": list(self.ids), "model": self.model})

    @classmethod
    def decode(cls, data: bytes) -> AbortMessage:
        """Raises only ProtocolError."""
        obj = message_map(unpack(data), "abort")
        ids = items(obj, "ids", "abort")
        if len(ids) > MAX_ABORT_IDS or not all(isinstance(i, str) and 0 < len(i) <= 256 for i in ids):
            raise ProtocolError(f"abort: ids must be at most {MAX_ABORT_IDS} non-empty strings")
        return cls(ids=list(ids), model=text(obj, "model", "abort", default=""))
