"""The engine worker: consumes its model's request stream and runs the engine.

Loop: pull new entries (blocking only when there is nothing to run) → start the next engine
step on the engine thread → while it runs, publish the previous step's tokens in one
MULTI/EXEC per step. Around every step the guards run (deadlines, gone gateways, ownership);
after every flush `engine.worker.failover` reacts to Redis trouble (re-adoption after a
failover, Redis data loss). The parts are built by `engine.worker.parts`. Side tasks: the
heartbeat (its own task, on cached figures), takeover of dead engines' entries, and the abort
listener. SIGTERM drains: no new work, running requests finish within `drain_timeout_s`, the
rest go back on the stream with their checkpoints."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import redis.asyncio as aioredis
from aiohttp import web
from redis.exceptions import RedisError, WatchError

from common.log import get_logger
from common.protocol import Keys
from common.redis_conn import Epoch, NotReplicated, ReplicaAck
from common.shutdown import shut_down
from engine.config import EngineConfig
from engine.worker.engine_thread import EngineThread, Queues, StepResult
from engine.worker.heartbeat import Heartbeat
from engine.worker.intake import Intake
from engine.worker.lora_sync import LoRASync
from engine.worker.metrics import start_metrics_server
from engine.worker.outbox import Fence, FenceLost, Outbox, flush
from engine.worker.parts import ThreadFactory, WorkerParts, build_parts, build_thread
from engine.worker.recovery import RecoveryState
from engine.worker.worker_config import WorkerConfig

__all__ = ["ConflictingEngine", "EngineWorker", "WorkerConfig"]

FENCE_TRIES = 8  # flush attempts per step when the heartbeat key changes under one
log = get_logger("worker")


class ConflictingEngine(ValueError):
    """Another live engine serves this model name with other weights, tokenizer or length."""


class EngineWorker:
    """One engine serving its model's request stream as consumer `engine_id` of group `engines`.
    Its parts are built by `engine.worker.parts`: the engine thread here, the rest once the model
    is loaded (`run`)."""

    def __init__(self, config: WorkerConfig, engine_config: EngineConfig,
                 thread_factory: ThreadFactory = EngineThread) -> None:
        self.config = config
        self.engine_config = engine_config
        self.keys = Keys(config.redis_prefix)
        # unsent outputs, checkpoints, readopt due, snapshot wanted: asked of it, never written here
        self.recovery = RecoveryState()
        self.thread = build_thread(config, self.recovery, thread_factory)
        self.stop = asyncio.Event()
        self.closing = False  # set on the way out: the side tasks' loops end at their next turn
        self.stats: dict[str, Any] = {}  # the engine's figures after the last step (metrics, heartbeat)
        self.queues = Queues()
        self.epoch = Epoch(self.keys.epoch(config.model_name))
        self.ack = ReplicaAck.of(config.redis_spec)
        self._drain_deadline: float | None = None

    async def run(self) -> None:
        """Load the model, then serve until `stop` is set and the drain is over."""
        await self.thread.start(self.engine_config)
        cfg = self.config
        parts = build_parts(cfg, self.engine_config, self.keys, self.thread, self.recovery, self.epoch)
        client, intake, beat = parts.client, parts.intake, parts.beat
        runner = None
        tasks: list[asyncio.Task[None]] = []
        try:
            conflicts = await beat.conflicts()
            if conflicts:
                raise ConflictingEngine(f"model name {cfg.model_name!r} is already served by engines with other "
                                        f"weights/tokenizer/max_model_len: {'; '.join(conflicts)}")
            await self.epoch.check(client)
            await intake.stream.ensure_group()
            if intake.routed is not None:  # group and set member before the first beat announces `routed`
                await intake.routed.ensure_group()
            if cfg.metrics_port is not None:
                runner = await start_metrics_server(parts.metrics, cfg.metrics_host, cfg.metrics_port)
            for own in intake.own_streams:
                await intake.admit(await own.read_own_pending(), claimed=True)
            await parts.beat_now()
            tasks = [asyncio.create_task(intake.listen_aborts(lambda: not self.closing), name="aborts"),
                     asyncio.create_task(self._heartbeats(parts), name="heartbeat"),
                     asyncio.create_task(self._takeovers(intake), name="takeover"),
                     asyncio.create_task(self._lora_sync(parts.lora_sync), name="lora-sync")]
            log.info("engine serving", engine_id=cfg.engine_id, model=cfg.model_name, stream=intake.stream.key)
            await self._loop(parts)
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
    async def _loop(self, parts: WorkerParts) -> None:
        """Steps run on the engine thread; the loop publishes one step while the next runs::

            engine thread   | step N        | step N+1        | step N+2  ...
            event loop      pull ─┘ publish N (MULTI/EXEC) ─┘ publish N+1 ...

        After step N returns, its outputs go to an outbox, new entries are pulled, and step
        N+1 starts before the outbox of N is flushed, so Redis round trips hide behind the
        model. When nothing is left to run, the loop blocks on XREADGROUP instead of spinning."""
        intake = parts.intake
        step: asyncio.Future[StepResult] | None = None
        while not self._done(intake) or step is not None:
            if step is None:
                if not self._busy(intake):
                    await self._pull(intake, block=True)
                    if not self._busy(intake):
                        await self._publish(parts, intake.take_pending())
                        continue
                step = self._start_step(parts)
            result = await step
            self.stats, self.queues = result.stats | intake.counters(), result.queues
            parts.metrics.update(self.stats)
            outbox = intake.take_pending()
            self._collect(parts, result, outbox)
            step = None
            if self._drain_due(intake, outbox):
                await self._publish(parts, outbox)
                continue
            if not self.stop.is_set():
                await self._pull(intake, block=False)
            if self._busy(intake):  # overlap: next step computes while this one is published
                step = self._start_step(parts)
            await self._publish(parts, outbox)

    def _start_step(self, parts: WorkerParts) -> asyncio.Future[StepResult]:
        parts.guards.expire()
        return asyncio.ensure_future(self.thread.call(self.thread.step, *parts.intake.take_jobs()))

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

    def _collect(self, parts: WorkerParts, result: StepResult, outbox: Outbox) -> None:
        """Engine deltas, rejections, failures and aborts → wire messages and acks; metrics."""
        now = time.time()
        for live, out in parts.intake.collect(result, outbox):
            parts.metrics.observe_finished(live.request.arrival, live.first_token_at, now, out.num_generated_tokens)

    async def _publish(self, parts: WorkerParts, outbox: Outbox) -> None:
        """Flush (after any earlier outbox that failed), unless the heartbeat lapsed: then first
        drop what other engines took over. Reads back gateway liveness and the epoch."""
        client, intake, guards, beat = parts.client, parts.intake, parts.guards, parts.beat
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
                    await self._check_ownership(parts)
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
        if await parts.failover.after_flush(reply.epoch):  # False: Redis lost its data, all was dropped
            guards.on_probe(reply.alive)

    async def _check_ownership(self, parts: WorkerParts) -> None:
        """Our heartbeat may have expired: rewrite it (from now on nobody can take our entries),
        then drop every request that is no longer pending under our name."""
        intake = parts.intake
        await parts.beat_now()
        by_stream: dict[str, dict[str, str]] = {}
        for t in intake.tracked.values():
            by_stream.setdefault(t.stream or intake.stream.key, {})[t.entry_id] = t.request_id
        lost: set[str] = set()
        for key, entries in by_stream.items():
            owned = await intake.stream_for(key).owned(list(entries))
            lost |= {rid for entry, rid in entries.items() if entry not in owned}
        parts.guards.lose(lost, "taken over by another engine while this one was silent")
        self.recovery.lose(lost)
        parts.beat.ownership_checked()

    # ----- side tasks --------------------------------------------------------------------------
    async def _heartbeats(self, parts: WorkerParts) -> None:
        """Every interval, from cached figures: never waits for the engine thread."""
        interval = self.config.heartbeat_interval_s
        while not self.closing:
            await asyncio.sleep(interval)
            parts.beat.draining = self.stop.is_set()
            try:
                await parts.beat_now()
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

