"""An engine's heartbeat: the ``{prefix}:engine:<id>`` hash (with a TTL) gateways read to find
live engines, their models, tokenizers and figures."""

from __future__ import annotations

import base64
import json
import math
from array import array
from dataclasses import dataclass, field
from typing import Any

from common.protocol.fields import ProtocolError, decoding

MAX_FIELD = 1 << 22  # bytes of one hash field (the pool snapshot of a 100k-block pool is far less)
MAX_CACHED = 16384  # block keys one heartbeat announces (128 KiB packed)
# vLLM's names of the reasoning parsers an engine may announce for its model (gateway/text/reasoning.py)
REASONING_PARSER_NAMES = ("deepseek_r1", "qwen3", "gpt_oss")


def pack_keys(keys: list[int]) -> str:
    """Block keys (unsigned 64-bit) as base64 of little-endian uint64s."""
    packed = array("Q", keys)
    if array("Q").itemsize != 8:  # pragma: no cover - every platform we run has 8-byte Q
        raise ProtocolError("heartbeat: uint64 array is not 8 bytes")
    return base64.b64encode(packed.tobytes()).decode()


def unpack_keys(text: str) -> list[int]:
    raw = base64.b64decode(text, validate=True)
    if len(raw) % 8:
        raise ProtocolError("heartbeat: cached keys not a multiple of 8 bytes")
    keys = array("Q")
    keys.frombytes(raw)
    return keys.tolist()


def _text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="strict")
    if isinstance(value, str):
        return value
    raise ProtocolError(f"heartbeat: field of type {type(value).__name__}")


def _float(value: str) -> float:
    number = float(value)
    if not math.isfinite(number):
        raise ProtocolError(f"heartbeat: non-finite number {value[:20]!r}")
    return number


@dataclass(slots=True, kw_only=True)
class EngineHeartbeat:
    """Contents of the ``{prefix}:engine:<id>`` hash. `model` is the served model name,
    `tokenizer` the directory a gateway loads the tokenizer and chat template from. `pool` is
    the run-length snapshot of the device block pool (`engine.kv.block_stats.pool_snapshot`:
    ``[[state, run_length], ...]``), stored as ``"state:run,state:run"`` in field ``pool``.
    `tables` are the block tables of running and swapped sequences
    (`engine.kv.block_stats.block_tables`), JSON in field ``tables``. `config_hash` and
    `vocab_size` identify the weights and tokenizer: engines announcing one name must agree,
    or failover between them would change answers. `draining` is set after SIGTERM.

    Routing: `routed` says the engine reads its own request stream
    (`Keys.routed`), so gateways may send requests there; `block_size` and `cached` (at most
    MAX_CACHED prefix-cache keys, `common.block_hash`, most recently used first, held in its
    device pool in use or free-but-revivable) say which prompt prefixes it would find cached.
    Field ``cached`` is base64 of little-endian uint64s. `reasoning_parser` (field
    ``reasoning_parser``, absent when empty) is the engine's ``--reasoning-parser``: how gateways
    split the model's thinking from its answer ("none": never; "": the chat template decides).
    `loras`: the LoRA adapters it serves over `model` (gateways list each as a model whose parent
    is `model`), JSON in field ``loras``; `lora_errors`: why adapters of `Keys.loras` could not be
    loaded here (name -> message)."""

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
    routed: bool = False
    block_size: int = 0
    cached: list[int] = field(default_factory=list)
    loras: list[str] = field(default_factory=list)
    lora_errors: dict[str, str] = field(default_factory=dict)
    runner: str = "generate"  # "pooling": the engine serves embeddings, not generation
    reasoning_parser: str = ""

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
        if self.routed:
            fields["routed"] = "1"
        if self.block_size:
            fields["block_size"] = str(self.block_size)
        if self.cached:
            fields["cached"] = pack_keys(self.cached[:MAX_CACHED])
        if self.loras:
            fields["loras"] = json.dumps(self.loras)
        if self.lora_errors:
            fields["lora_errors"] = json.dumps(self.lora_errors)
        if self.runner != "generate":
            fields["runner"] = self.runner
        if self.reasoning_parser:
            fields["reasoning_parser"] = self.reasoning_parser
        if self.tables:
            fields["tables"] = json.dumps(self.tables, separators=(",", ":"))
        return fields

    @classmethod
    def from_hash(cls, data: dict[Any, Any]) -> EngineHeartbeat:
        """Raises only ProtocolError, whatever the hash holds."""
        with decoding("heartbeat"):
            text = {_text(k): _text(v) for k, v in data.items()}
            if any(len(v) > MAX_FIELD for v in text.values()):
                raise ProtocolError("heartbeat: a field is too large")
            loras = json.loads(text.get("loras", "[]"))
            if not isinstance(loras, list) or not all(isinstance(n, str) and n for n in loras):
                raise ProtocolError("heartbeat: loras must be a list of names")
            lora_errors = json.loads(text.get("lora_errors", "{}"))
            if not isinstance(lora_errors, dict) or not all(isinstance(v, str) for v in lora_errors.values()):
                raise ProtocolError("heartbeat: lora_errors must map names to messages")
            tables = json.loads(text.get("tables", "[]"))
            if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
                raise ProtocolError("heartbeat: tables must be a list of maps")
            beat = cls(
                engine_id=text["engine_id"], model=text["model"], tokenizer=text.get("tokenizer", ""),
                max_model_len=int(text.get("max_model_len", "0")), time=_float(text.get("time", "0")),
                stats={k[5:]: _float(v) for k, v in text.items() if k.startswith("stat:")},
                pool=[[int(x) for x in run.split(":", 1)] for run in text.get("pool", "").split(",") if run],
                tables=tables, config_hash=text.get("config_hash", ""),
                vocab_size=int(text.get("vocab_size", "0")), draining=text.get("draining", "0") == "1",
                routed=text.get("routed", "0") == "1", block_size=int(text.get("block_size", "0")),
                cached=unpack_keys(text.get("cached", ""))[:MAX_CACHED],
                runner=text.get("runner", "generate"),
                reasoning_parser=text.get("reasoning_parser", ""), loras=loras, lora_errors=lora_errors,
            )
            if beat.runner not in ("generate", "pooling"):
                raise ProtocolError(f"heartbeat: unknown runner {beat.runner[:20]!r}")
            if beat.block_size < 0 or (beat.cached and beat.block_size == 0):
                raise ProtocolError("heartbeat: cached keys without a positive block size")
            if not beat.engine_id or not beat.model or beat.max_model_len < 0 or beat.vocab_size < 0:
                raise ProtocolError("heartbeat: empty engine id or model, or a negative size")
            if any(len(run) != 2 or run[1] < 0 for run in beat.pool):
                raise ProtocolError("heartbeat: bad pool snapshot")
            return beat
