"""`WorkerConfig`: the Redis side of an engine worker (`pagedserve engine`'s flags past the engine's)."""

from __future__ import annotations

from dataclasses import dataclass

from common.protocol import DEFAULT_PREFIX
from common.redis_spec import RedisSpec
from engine.worker.guards import GATEWAY_GRACE_S


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """Redis side of an engine worker."""

    engine_id: str
    model_name: str
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis: RedisSpec | None = None  # a Sentinel setup (or WAIT settings); None: `redis_url` alone
    redis_prefix: str = DEFAULT_PREFIX
    metrics_host: str = "0.0.0.0"
    metrics_port: int | None = None
    heartbeat_interval_s: float = 1.0
    claim_after_s: float | None = None  # default: 5 heartbeat intervals
    progress_ttl_s: int = 3600
    max_pull: int = 64
    idle_block_ms: int = 500
    max_claims: int = 3
    gateway_grace_s: float = GATEWAY_GRACE_S  # --gateway-grace
    drain_timeout_s: float = 30.0
    redis_pool_size: int = 16
    redis_pool_timeout_s: float = 10.0
    routing: bool = True  # read an own routed stream first and announce it (cache-aware routing)
    steal_after_s: float | None = 3.0  # with routing: take peers' routed entries waiting this long; None: never
    reasoning_parser: str = ""  # announced to gateways: how they split thinking from the answer ("": the template)

    @property
    def redis_spec(self) -> RedisSpec:
        return self.redis if self.redis is not None else RedisSpec(url=self.redis_url)

    @property
    def claim_after_ms(self) -> int:
        return int(1000 * (self.claim_after_s or 5 * self.heartbeat_interval_s))

    @property
    def steal_after_ms(self) -> int | None:
        """With routing: how long a peer's routed entry waits before this engine may take it; None: never."""
        return None if not self.routing or self.steal_after_s is None else int(self.steal_after_s * 1000)
