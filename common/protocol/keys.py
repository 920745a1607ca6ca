"""Redis stream, channel and key names, all derived from one prefix (`--redis-prefix`)."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_PREFIX = "ps"
CONSUMER_GROUP = "engines"
REQUEST_FIELD = "m"


@dataclass(frozen=True, slots=True)
class Keys:
    """Redis stream, channel and key names derived from one prefix."""

    prefix: str = DEFAULT_PREFIX

    def requests(self, model: str) -> str:
        """The request stream of one served model name."""
        return f"{self.prefix}:requests:{model}"

    def routed(self, model: str, engine_id: str) -> str:
        """The request stream of one engine of `model` (consumer group `engines`, like the shared
        stream): gateways put a request there when that engine holds its longest cached prefix;
        the engine reads it before the shared stream, and an idle peer steals entries left
        waiting there (work stealing), so routing never makes a request wait for a busy engine."""
        return f"{self.prefix}:routed:{model}:{engine_id}"

    def routed_streams(self, model: str) -> str:
        """Set of the per-engine streams (`routed`) of `model` that may hold entries: an engine
        adds its own before it announces `routed` in its heartbeat; peers read the set to steal
        from and take over a dead engine's stream, and remove a stream once it is empty and its
        engine is gone."""
        return f"{self.prefix}:routed-streams:{model}"

    def dead(self, model: str) -> str:
        """Dead-letter stream of `model`: entries no engine could serve (undecodable, or taken
        over too many times), each with its reason and raw bytes."""
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
        """Pattern matching every engine heartbeat hash (for operators; discovery reads
        `engines` and never scans)."""
        return f"{self.prefix}:engine:*"

    @property
    def engines(self) -> str:
        """Sorted set of engine ids scored by their last heartbeat's time (`common.engine_set`)."""
        return f"{self.prefix}:engines"

    def out(self, gateway_id: str) -> str:
        """The gateway's output stream (read by id)."""
        return f"{self.prefix}:out:{gateway_id}"

    def gateway(self, gateway_id: str) -> str:
        """The gateway's liveness key (with a TTL)."""
        return f"{self.prefix}:gateway:{gateway_id}"

    def loras(self, model: str) -> str:
        """Hash of the LoRA adapters loaded over `model` at run time (name -> PEFT folder): what
        `POST /v1/load_lora_adapter` adds and every engine of the model applies."""
        return f"{self.prefix}:loras:{model}"

    def engine(self, engine_id: str) -> str:
        return f"{self.prefix}:engine:{engine_id}"

    def progress(self, request_id: str) -> str:
        return f"{self.prefix}:progress:{request_id}"

    def response(self, response_id: str) -> str:
        """A stored /v1/responses response and its conversation (JSON, with a TTL), read by
        every gateway for `previous_response_id` and `GET /v1/responses/{id}`."""
        return f"{self.prefix}:response:{response_id}"
