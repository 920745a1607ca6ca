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

    def engine(self, engine_id: str) -> str:
        return f"{self.prefix}:engine:{engine_id}"

    def progress(self, request_id: str) -> str:
        return f"{self.prefix}:progress:{request_id}"
