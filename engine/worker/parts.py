"""The engine worker's parts, each built complete in one place: every flag a part runs by is a
constructor argument here, and nothing is set on a part after it is built.

Two phases, because most parts need the loaded engine: `build_thread` before the model loads
(the engine thread loads it), `build_parts` after. `WorkerParts` groups what the worker's loop
and side tasks are handed together."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import redis.asyncio as aioredis

from common.protocol import Keys
from common.protocol.heartbeat import MAX_CACHED
from common.redis_conn import Epoch, pooled_client
from engine.config import EngineConfig
from engine.worker.engine_thread import EngineThread
from engine.worker.failover import Failover, data_loss_hook
from engine.worker.guards import Guards
from engine.worker.heartbeat import Heartbeat, model_config_hash
from engine.worker.intake import Intake
from engine.worker.lora_sync import LoRASync
from engine.worker.metrics import EngineMetrics
from engine.worker.recovery import RecoveryState
from engine.worker.request_stream import RequestStream
from engine.worker.worker_config import WorkerConfig

# builds the engine thread: (recovery, cached_limit) -> thread (a fake engine's in benchmarks)
ThreadFactory = Callable[[RecoveryState, int], EngineThread]


@dataclass(frozen=True, slots=True)
class WorkerParts:
    """The parts a running worker works with, built together once the engine is loaded."""

    client: aioredis.Redis  # the pooled Redis client every part shares
    intake: Intake  # what flows in: stream entries, takeovers, aborts; the tracked-requests table
    guards: Guards  # the checks around every step
    beat: Heartbeat  # this engine's heartbeat key
    metrics: EngineMetrics  # Prometheus figures
    lora_sync: LoRASync  # the adapters loaded at run time
    failover: Failover  # what the worker does after Redis trouble
    beat_now: Callable[[], Awaitable[None]]  # write the heartbeat now, from the engine's cached figures


def build_thread(config: WorkerConfig, recovery: RecoveryState,
                 factory: ThreadFactory = EngineThread) -> EngineThread:
    """The engine thread; with routing its snapshots list the prefix-cache keys the heartbeat announces."""
    return factory(recovery, MAX_CACHED if config.routing else 0)


def build_parts(config: WorkerConfig, engine_config: EngineConfig, keys: Keys, thread: EngineThread,
                recovery: RecoveryState, epoch: Epoch) -> WorkerParts:
    """Every part of a worker whose engine `thread` has loaded its model. Nothing here talks to
    Redis yet: the worker sets up the consumer groups before the first heartbeat announces them."""
    engine = thread.engine
    client = pooled_client(config.redis_spec, config.redis_pool_size, config.redis_pool_timeout_s,
                           health_check_interval=10, socket_connect_timeout=2.0)
    stream = RequestStream(client, keys, config.model_name, config.engine_id)
    routed = None
    if config.routing:
        routed = RequestStream(client, keys, config.model_name, config.engine_id,
                               key=keys.routed(config.model_name, config.engine_id),
                               register=keys.routed_streams(config.model_name))
    intake = Intake(client, keys, stream, config.model_name, config.max_claims, epoch,
                    on_data_lost=data_loss_hook(recovery), routed=routed, steal_after_ms=config.steal_after_ms)
    beat = Heartbeat(client, keys, config.engine_id, config.model_name, engine.tokenizer_dir, engine.max_model_len,
                     ttl_s=config.claim_after_ms / 1000, config_hash=model_config_hash(str(engine.config.model)),
                     vocab_size=engine.vocab_size, runner=engine.runner_kind,
                     reasoning_parser=config.reasoning_parser,
                     routed_block_size=engine_config.block_size if routed is not None else None,
                     loras=engine.lora_names())  # the --lora-modules it serves (read before any step runs)

    async def beat_now() -> None:
        stats, pool = thread.snapshot_cache
        recovery.request_snapshot()  # the next step refreshes pool and block tables
        await beat.beat(stats, pool, intake.counters())

    return WorkerParts(client=client, intake=intake, guards=Guards(intake, config.gateway_grace_s), beat=beat,
                       metrics=EngineMetrics(engine.device.type),
                       lora_sync=LoRASync(client, keys, config.model_name, thread, beat),
                       failover=Failover(client, intake, recovery, epoch), beat_now=beat_now)
