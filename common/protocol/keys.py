"""Redis stream, channel and key names, all derived from one prefix (`--redis-prefix`).

Keys carry Redis Cluster hash tags (the part in braces decides the slot), so that every
script and transaction touches one slot and the load spreads over a cluster's masters:

- per model ``{m:<model>}``: its request stream, routed streams and their set, dead letters,
  LoRA set, dataset epoch, and the engines' liveness copies (`alive`) the takeover checks;
- per gateway ``{g:<gateway>}``: its output stream, liveness key and the progress checkpoints
  of its requests (written in the same transaction as their output);
- per engine ``{e:<engine>}``: its heartbeat hash.

The engine set, the abort channel and stored responses are single keys without a tag. On a
single Redis (or Sentinel) the tags change nothing but the names."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_PREFIX = "ps"
CONSUMER_GROUP = "engines"
REQUEST_FIELD = "m"


@dataclass(frozen=True, slots=True)
class Keys:
    """Redis stream, channel and key names derived from one prefix."""

    prefix: str = DEFAULT_PREFIX

    def __post_init__(self) -> None:
        if "{" in self.prefix or "}" in self.prefix:
            raise ValueError(f"the Redis prefix {self.prefix!r} may not contain braces (they pick cluster slots)")

    def _model(self, model: str) -> str:
        return f"{self.prefix}:{{m:{model}}}"

    def _gateway(self, gateway_id: str) -> str:
        return f"{self.prefix}:{{g:{gateway_id}}}"

    def requests(self, model: str) -> str:
        """The request stream of one served model name."""
        return f"{self._model(model)}:requests"

    def routed(self, model: str, engine_id: str) -> str:
        """The request stream of one engine of `model` (consumer group `engines`, like the shared
        stream): gateways put a request there when that engine holds its longest cached prefix;
        the engine reads it before the shared stream, and an idle peer steals entries left
        waiting there (work stealing), so routing never makes a request wait for a busy engine."""
        return f"{self._model(model)}:routed:{engine_id}"

    def routed_streams(self, model: str) -> str:
        """Set of the per-engine streams (`routed`) of `model` that may hold entries: an engine
        adds its own before it announces `routed` in its heartbeat; peers read the set to steal
        from and take over a dead engine's stream, and remove a stream once it is empty and its
        engine is gone."""
        return f"{self._model(model)}:routed-streams"

    def dead(self, model: str) -> str:
        """Dead-letter stream of `model`: entries no engine could serve (undecodable, or taken
        over too many times), each with its reason and raw bytes."""
        return f"{self._model(model)}:dead"

    def epoch(self, model: str) -> str:
        """The dataset epoch of `model`'s slot: a token set once; a different or missing one
        means the Redis holding the model's keys lost its data (`common.redis_conn.Epoch`)."""
        return f"{self._model(model)}:epoch"

    def alive(self, model: str, engine_id: str) -> str:
        """An engine's liveness key in its model's slot (written with the heartbeat, same TTL):
        peers take over the engine's entries only once it is gone, and the engine's flushes are
        fenced on it."""
        return f"{self._model(model)}:alive:{engine_id}"

    @property
    def group(self) -> str:
        return CONSUMER_GROUP

    @property
    def abort(self) -> str:
        return f"{self.prefix}:abort"

    @property
    def engine_pattern(self) -> str:
        """Pattern matching every engine heartbeat hash (for operators; discovery reads
        `engines` and never scans)."""
        return f"{self.prefix}:{{e:*}}:engine"

    @property
    def engines(self) -> str:
        """Sorted set of engine ids scored by their last heartbeat's time (`common.engine_set`)."""
        return f"{self.prefix}:engines"

    def out(self, gateway_id: str) -> str:
        """The gateway's output stream (read by id)."""
        return f"{self._gateway(gateway_id)}:out"

    def gateway(self, gateway_id: str) -> str:
        """The gateway's liveness key (with a TTL)."""
        return f"{self._gateway(gateway_id)}:gateway"

    def progress(self, gateway_id: str, request_id: str) -> str:
        """The progress checkpoints of one request, in its gateway's slot (written in the same
        transaction as the output they describe)."""
        return f"{self._gateway(gateway_id)}:progress:{request_id}"

    @property
    def progress_pattern(self) -> str:
        """Pattern matching every request's checkpoints (for operators and tests)."""
        return f"{self.prefix}:{{g:*}}:progress:*"

    def loras(self, model: str) -> str:
        """Hash of the LoRA adapters loaded over `model` at run time (name -> PEFT folder): what
        `POST /v1/load_lora_adapter` adds and every engine of the model applies."""
        return f"{self._model(model)}:loras"

    def engine(self, engine_id: str) -> str:
        """An engine's heartbeat hash (with a TTL)."""
        return f"{self.prefix}:{{e:{engine_id}}}:engine"

    def response(self, response_id: str) -> str:
        """A stored /v1/responses response and its conversation (JSON, with a TTL), read by
        every gateway for `previous_response_id` and `GET /v1/responses/{id}`."""
        return f"{self.prefix}:response:{response_id}"
