"""Gateway configuration: one frozen dataclass built by the CLI or by tests."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from common.protocol import DEFAULT_PREFIX
from common.redis_spec import RedisSpec


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """Everything `create_app` needs. `models` maps served model names to tokenizer
    directories and overrides what engine heartbeats announce."""

    host: str = "0.0.0.0"
    port: int = 8000
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis: RedisSpec | None = None  # a Sentinel setup (or WAIT settings); None: `redis_url` alone
    redis_prefix: str = DEFAULT_PREFIX
    gateway_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    api_keys: tuple[str, ...] = ()
    models: tuple[tuple[str, str], ...] = ()
    max_body_bytes: int = 1 << 20
    max_n: int = 16
    max_tokens_limit: int = 8192
    max_stop_strings: int = 16
    max_stop_length: int = 256
    max_top_logprobs: int = 20
    request_timeout_s: float = 600.0
    engine_stale_s: float = 15.0
    sse_ping_s: float = 15.0  # how often a waiting request checks its client (and deadline)
    sse_keepalive_s: float = 0.0  # SSE comment frames after this many idle seconds; 0 = never
    write_timeout_s: float = 30.0  # a client that reads nothing this long has its request aborted
    # Redis: a pool that waits (bounded) for a free connection instead of failing a burst
    redis_pool_size: int = 64
    redis_pool: str = "blocking"  # "plain": redis-py's default pool, which fails a burst at once (benchmarks)
    redis_pool_timeout_s: float = 20.0
    max_queued_per_model: int = 4096  # un-finished requests in a model's stream; past it 429
    retry_after_s: int = 1
    orphan_after_s: float = 10.0  # fail a model's requests when it had no live engine this long
    watch_interval_s: float = 1.0
    # cache-aware routing (gateway/broker/router.py): to the engine holding the longest cached prefix
    routing: bool = True
    route_load_slack: float = 4.0  # requests more than the least loaded engine before routing by load
    rate_limits_path: str | None = None  # per-API-key limits file (gateway/ratelimit_config.py); None: no limits
    # /v1/responses kept in Redis for previous_response_id and GET: how long, and the largest kept (0: none)
    responses_ttl_s: int = 86400
    responses_max_bytes: int = 1 << 20
    # --reasoning-parser: (model name, parser name) pairs, model "" for every model; they override what
    # engines announce and what chat templates imply (gateway/text/reasoning.py)
    reasoning_parsers: tuple[tuple[str, str], ...] = ()

    def reasoning_parser_for(self, model: str) -> str | None:
        """This gateway's --reasoning-parser for `model` (a parser name or "none"), None when not set."""
        named = dict(self.reasoning_parsers)
        return named.get(model, named.get(""))

    @property
    def redis_spec(self) -> RedisSpec:
        """Where Redis is: `redis` when given, else `redis_url`."""
        return self.redis if self.redis is not None else RedisSpec(url=self.redis_url)

    def __post_init__(self) -> None:
        if self.max_body_bytes <= 0 or self.max_n <= 0 or self.max_tokens_limit <= 0:
            raise ValueError("max_body_bytes, max_n and max_tokens_limit must be positive")
        if self.sse_keepalive_s < 0 or self.write_timeout_s <= 0:
            raise ValueError("sse_keepalive_s must be >= 0 and write_timeout_s positive")
        if self.redis_pool_size < 2 or self.redis_pool_timeout_s <= 0 or self.max_queued_per_model < 1:
            raise ValueError("redis_pool_size must be >= 2, redis_pool_timeout_s and max_queued_per_model positive")
        if self.responses_ttl_s < 0 or self.responses_max_bytes < 0:
            raise ValueError("responses_ttl_s and responses_max_bytes must be >= 0")
        if self.route_load_slack < 0:
            raise ValueError("route_load_slack must be >= 0")
        if not self.redis_prefix or ":" in self.redis_prefix:
            raise ValueError("redis_prefix must be a non-empty name without ':'")
