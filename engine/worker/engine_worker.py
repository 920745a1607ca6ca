"""The engine worker: consumes its model's request stream and runs the engine.

Loop: pull new entries (blocking only when there is nothing to run) → start the next engine
step on the engine thread → while it runs, publish the previous step's tokens in one
MULTI/EXEC per step. Around every step the guards run (deadlines, gone gateways, ownership,
Redis data loss). Side tasks: the heartbeat (its own task, on cached figures), takeover of
dead engines' entries, and the abort listener. SIGTERM drains: no new work, running
requests finish within `drain_timeout_s`, the rest go back on the stream with their
checkpoints."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from aiohttp import web
from redis.exceptions import RedisError, WatchError

from common.log import get_logger
from common.protocol import DEFAULT_PREFIX, Keys
from common.protocol.heartbeat import MAX_CACHED
from common.redis_conn import Epoch, NotReplicated, ReplicaAck, pooled_client
from common.redis_spec import RedisSpec
from common.shutdown import shut_down
from engine.config import EngineConfig
from engine.worker.engine_thread import EngineThread, Queues, StepResult
from engine.worker.guards import GATEWAY_GRACE_S, Guards
from engine.worker.heartbeat import Heartbeat, model_config_hash
from engine.worker.intake import Intake
from engine.worker.lora_sync import LoRASync
from engine.worker.metrics import EngineMetrics, start_metrics_server
from engine.worker.outbox import Fence, FenceLost, Outbox, flush
from engine.worker.recovery import RecoveryState
from engine.worker.request_stream import RequestStream

FENCE_TRIES = 8  # flush attempts per step when the heartbeat key changes under one
log = get_logger("worker")


class ConflictingEngine(ValueError):
    """Another live engine serves this model name with other weights, tokenizer or length."""


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


class EngineWorker:
    """One engine serving its model's request stream as consumer `engine_id` of group `engines`."""

    def __init__(self, config: WorkerConfig, engine_config: EngineConfig) -> None:
        self.config = config
        self.engine_config = engine_config
        self.keys = Keys(config.redis_prefix)
        # unsent outputs, checkpoints, readopt due, snapshot wanted: asked of it, never written here
        self.recovery = RecoveryState()
        self.thread = EngineThread(self.recovery)
        self.stop = asyncio.Event()
        self.closing = False  # set on the way out: the side tasks' loops end at their next turn
        self.stats: dict[str, Any] = {}  # the engine's figures after the last step (metrics, heartbeat)
        self.queues = Queues()
        self.metrics: EngineMetrics | None = None
        self.epoch = Epoch(self.keys.epoch(config.model_name))
        self.ack = ReplicaAck.of(config.redis_spec)
        self._drain_deadline: float | None = None

    async def run(self) -> None:
        """Load the model, then serve until `stop` is set and the drain is over."""
        await self.thread.start(self.engine_config)
        engine = self.thread.engine
        cfg = self.config
        client = pooled_client(cfg.redis_spec, cfg.redis_pool_size, cfg.redis_pool_timeout_s, health_check_interval=10,
                               socket_connect_timeout=2.0)
        self.metrics = EngineMetrics(engine.device.type)
        stream = RequestStream(client, self.keys, cfg.model_name, cfg.engine_id)
        routed = None
        if cfg.routing:
            routed = RequestStream(client, self.keys, cfg.model_name, cfg.engine_id,
                                   key=self.keys.routed(cfg.model_name, cfg.engine_id),
                                   register=self.keys.routed_streams(cfg.model_name))
        steal_ms = None if not cfg.routing or cfg.steal_after_s is None else int(cfg.steal_after_s * 1000)
        intake = Intake(client, self.keys, stream, cfg.model_name, cfg.max_claims, self.epoch, routed=routed,
                        steal_after_ms=steal_ms)
        guards = Guards(intake, cfg.gateway_grace_s)
        intake.on_data_lost = lambda: self._forget_everything(intake)
        beat = Heartbeat(client, self.keys, cfg.engine_id, cfg.model_name, engine.tokenizer_dir,
                         engine.max_model_len, ttl_s=cfg.claim_after_ms / 1000,
                         config_hash=model_config_hash(str(engine.config.model)), vocab_size=engine.vocab_size,
                         runner=engine.runner_kind,
                         reasoning_parser=cfg.reasoning_parser)
        beat.loras = engine.lora_names()  # the --lora-modules it serves (read before any step runs)
        runner = None
        tasks: list[asyncio.Task[None]] = []
        try:
            conflicts = await beat.conflicts()
            if conflicts:
                raise ConflictingEngine(f"model name {cfg.model_name!r} is already served by engines with other "
                                        f"weights/tokenizer/max_model_len: {'; '.join(conflicts)}")
            await self.epoch.check(client)
            await stream.ensure_group()
            if routed is not None:  # group and set member first: then the heartbeat may announce `routed`
                await routed.ensure_group()
                beat.routed_block_size = self.engine_config.block_size
                self.thread.cached_limit = MAX_CACHED
            if cfg.metrics_port is not None:
                runner = await start_metrics_server(self.metrics, cfg.metrics_host, cfg.metrics_port)
            for own in intake.own_streams:
                await intake.admit(await own.read_own_pending(), claimed=True)
            await self._beat(beat, intake)
            tasks = [asyncio.create_task(intake.listen_aborts(lambda: not self.closing), name="aborts"),
                     asyncio.create_task(self._heartbeats(beat, intake), name="heartbeat"),
                     asyncio.create_task(self._takeovers(intake), name="takeover"),
                     asyncio.create_task(self._lora_sync(LoRASync(client, self.keys, cfg.model_name, self.thread,
                                                                  beat)), name="lora-sync")]
            log.info("engine serving", engine_id=cfg.engine_id, model=cfg.model_name, stream=stream.key)
            await self._loop(client, intake, guards, beat)
        finally:
            await self._shut(tasks, beat, runner, client)

    async def _shut(self, tasks: list[asyncio.Task[None]], beat: Heartbeat, runner: web.AppRunner | None,
                    client: aioredis.Redis) -> None:
        """Stop the side tasks, drop the heartbeat, close the servers and connections (each step
        bounded: `common.shutdown`), stop the engine thread."""
        self.closing = True
        steps = [beat.remove(), *([runner.cleanup()] if runner is not None else []),
                 client.aclose(close_connection_pool=True)]
        await shut_down("engine", tasks, steps)
        self.thread.close()

    # ----- the main loop -----------------------------------------------------------------------
    async def _loop(self, client: aioredis.Redis, intake: Intake, guards: Guards, beat: Heartbeat) -> None:
        """Steps run on the engine thread; the loop publishes one step while the next runs::

            engine thread   | step N        | step N+1        | step N+2  ...
            event loop      pull ─┘ publish N (MULTI/EXEC) ─┘ publish N+1 ...

        After step N returns, its outputs go to an outbox, new entries are pulled, and step
        N+1 starts before the outbox of N is flushed, so Redis round trips hide behind the
        model. When nothing is left to run, the loop blocks on XREADGROUP instead of spinning."""
        step: asyncio.Future[StepResult] | None = None
        while not self._done(intake) or step is not None:
            if step is None:
                if not self._busy(intake):
                    await self._pull(intake, block=True)
                    if not self._busy(intake):
                        await self._publish(client, intake, guards, beat, intake.take_pending())
                        continue
                step = self._start_step(intake, guards)
            result = await step
            self.stats, self.queues = result.stats | intake.counters(), result.queues
            assert self.metrics is not None
            self.metrics.update(self.stats)
            outbox = intake.take_pending()
            self._collect(intake, result, outbox)
            step = None
            if self._drain_due(intake, outbox):
                await self._publish(client, intake, guards, beat, outbox)
                continue
            if not self.stop.is_set():
                await self._pull(intake, block=False)
            if self._busy(intake):  # overlap: next step computes while this one is published
                step = self._start_step(intake, guards)
            await self._publish(client, intake, guards, beat, outbox)

    def _start_step(self, intake: Intake, guards: Guards) -> asyncio.Future[StepResult]:
        guards.expire()
        return asyncio.ensure_future(self.thread.call(self.thread.step, *intake.take_jobs()))

    def _done(self, intake: Intake) -> bool:
        """Stopping and nothing left to run (or hand back)."""
        return self.stop.is_set() and intake.is_empty and not self.recovery.has_unsent

    def _drain_due(self, intake: Intake, outbox: Outbox) -> bool:
        """After SIGTERM: past the drain timeout, hand every tracked request back."""
        if not self.stop.is_set():
            return False
        if self._drain_deadline is None:
            self._drain_deadline = time.monotonic() + self.config.drain_timeout_s
            log.info("draining", requests=len(intake.tracked), timeout_s=self.config.drain_timeout_s)
        if intake.tracked and time.monotonic() >= self._drain_deadline:
            log.info("drain timeout: handing requests back", requests=intake.hand_back(outbox))
            return True
        return False

    def _busy(self, intake: Intake) -> bool:
        return self.queues.total > 0 or intake.has_work

    async def _pull(self, intake: Intake, block: bool) -> None:
        if self.stop.is_set():
            if block:
                await asyncio.sleep(0.05)
            return
        room = self.engine_config.max_num_seqs - self.queues.running - len(intake.jobs)
        count = min(self.config.max_pull, room) if self.queues.waiting == 0 else 0
        try:
            await intake.pull(count, self.config.idle_block_ms if block else None)
        except (RedisError, OSError) as exc:
            log.warning("cannot read the request stream", error=str(exc))
            self.recovery.note_redis_trouble()
            await asyncio.sleep(0.5)

    def _collect(self, intake: Intake, result: StepResult, outbox: Outbox) -> None:
        """Engine deltas, rejections, failures and aborts → wire messages and acks; metrics."""
        now = time.time()
        for live, out in intake.collect(result, outbox):
            if self.metrics is not None:
                self.metrics.observe_finished(live.request.arrival, live.first_token_at, now, out.num_generated_tokens)

    async def _publish(self, client: aioredis.Redis, intake: Intake, guards: Guards, beat: Heartbeat,
                       outbox: Outbox) -> None:
        """Flush (after any earlier outbox that failed), unless the heartbeat lapsed: then first
        drop what other engines took over. Reads back gateway liveness and the epoch."""
        self.recovery.note_unsent(outbox)
        margin = min(1.0, beat.ttl_s / 4)
        fence = Fence(beat.alive_key, lambda: beat.fresh(margin_s=margin))
        try:
            for _ in range(FENCE_TRIES):
                try:
                    unsent = self.recovery.unsent
                    reply = await flush(client, self.keys, intake.stream.key, unsent,
                                        self.config.progress_ttl_s, guards.gateways_to_probe(), fence, self.ack,
                                        self.recovery.checkpoints, self.epoch.key)
                    break
                except FenceLost:  # silent for too long: drop what other engines took over, then flush
                    await self._check_ownership(intake, guards, beat)
                except WatchError:  # the heartbeat key changed before EXEC (ours, or it expired): again
                    continue
            else:
                log.warning("could not publish outputs: the heartbeat key kept changing; will retry")
                return
        except NotReplicated as exc:  # written, but maybe lost with its master: send it again (repeats are dropped)
            log.warning("outputs not confirmed by a replica; will send them again", error=str(exc))
            self.recovery.note_redis_trouble()
            await asyncio.sleep(0.2)
            return
        except (RedisError, OSError) as exc:
            log.warning("could not publish outputs; will retry", error=str(exc))
            self.recovery.note_redis_trouble()
            await asyncio.sleep(0.2)
            return
        self.recovery.sent(unsent)
        if self.recovery.take_readopt():  # writes the old master acknowledged may be missing from this one
            await self._readopt(intake)
        if self.epoch.token is not None and reply.epoch != self.epoch.token:
            await self._redis_lost(client, intake, reply.epoch)
            return
        guards.on_probe(reply.alive)

    async def _readopt(self, intake: Intake) -> None:
        """`Intake.readopt` once Redis answers again (due again when it fails)."""
        try:
            await intake.readopt()
        except (RedisError, OSError) as exc:
            log.warning("cannot check this engine's pending entries; will retry", error=str(exc))
            self.recovery.note_redis_trouble()

    async def _check_ownership(self, intake: Intake, guards: Guards, beat: Heartbeat) -> None:
        """Our heartbeat may have expired: rewrite it (from now on nobody can take our entries),
        then drop every request that is no longer pending under our name."""
        await self._beat(beat, intake)
        by_stream: dict[str, dict[str, str]] = {}
        for t in intake.tracked.values():
            by_stream.setdefault(t.stream or intake.stream.key, {})[t.entry_id] = t.request_id
        lost: set[str] = set()
        for key, entries in by_stream.items():
            owned = await intake.stream_for(key).owned(list(entries))
            lost |= {rid for entry, rid in entries.items() if entry not in owned}
        guards.lose(lost, "taken over by another engine while this one was silent")
        self.recovery.lose(lost)
        beat.suspect = False

    def _forget_everything(self, intake: Intake) -> None:
        """Redis restarted without persistence: every in-flight request is gone there (its
        gateway fails it with a clear error), so drop them all and publish nothing for them."""
        lost = intake.forget_all()
        log.error("Redis lost its data (epoch changed): dropped in-flight requests", requests=len(lost))
        self.recovery.data_lost()

    async def _redis_lost(self, client: aioredis.Redis, intake: Intake, seen: str | None) -> None:
        """Drop everything once, adopt the epoch the flush read (`seen`), then set one up when there
        was none and recreate the consumer group. Redis has just come back and pooled connections
        may still point at the old server: a failure here is logged, not raised (it stopped an
        engine once: "Connection closed by server" out of the epoch check), since the next read
        recreates the group on NOGROUP and the next flush reads the epoch again."""
        self._forget_everything(intake)
        if seen is not None:
            self.epoch.token = seen  # requests admitted from now on are not dropped again
        try:
            await self.epoch.check(client)
            for own in intake.own_streams:
                await own.ensure_group()
        except (RedisError, OSError) as exc:
            log.warning("after the data loss: epoch or consumer group not set up yet; will retry", error=str(exc))

    # ----- side tasks --------------------------------------------------------------------------
    async def _heartbeats(self, beat: Heartbeat, intake: Intake) -> None:
        """Every interval, from cached figures: never waits for the engine thread."""
        interval = self.config.heartbeat_interval_s
        while not self.closing:
            await asyncio.sleep(interval)
            beat.draining = self.stop.is_set()
            try:
                await self._beat(beat, intake)
            except (RedisError, OSError) as exc:
                log.warning("heartbeat failed", error=str(exc))
                self.recovery.note_redis_trouble()

    async def _lora_sync(self, sync: LoRASync) -> None:
        """Every interval: the adapters loaded over this model at run time (`engine.worker.lora_sync`)."""
        while not self.closing:
            try:
                await sync.sync()
            except (RedisError, OSError) as exc:
                log.warning("lora sync failed", error=str(exc))
            await asyncio.sleep(self.config.heartbeat_interval_s)

    async def _beat(self, beat: Heartbeat, intake: Intake) -> None:
        stats, pool = self.thread.snapshot_cache
        self.recovery.request_snapshot()  # the next step refreshes pool and block tables
        await beat.beat(stats, pool, intake.counters())

    async def _takeovers(self, intake: Intake) -> None:
        """Every interval: take over entries of dead engines of this model."""
        interval = self.config.heartbeat_interval_s
        while not self.closing:
            await asyncio.sleep(interval)
            if self.stop.is_set():
                continue
            try:
                await intake.claim(self.config.claim_after_ms)
            except (RedisError, OSError) as exc:
                log.warning("takeover scan failed", error=str(exc))

