"""The engine worker: consumes the Redis request stream and runs the engine.

Loop: pull new entries (blocking only when there is nothing to run) → start the next engine
step on the engine thread → while it runs, publish the previous step's tokens in one
MULTI/EXEC per step. Side tasks: heartbeat + touching own pending entries + claiming dead
engines' entries (one maintenance task), and the abort listener."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from engine.config import EngineConfig
from engine.log import get_logger
from engine.protocol import DEFAULT_PREFIX, Keys
from engine.worker.engine_thread import EngineThread, StepResult
from engine.worker.heartbeat import Heartbeat
from engine.worker.intake import Intake
from engine.worker.metrics import EngineMetrics, start_metrics_server
from engine.worker.outbox import Outbox, flush
from engine.worker.request_stream import RequestStream
from engine.worker.tracked import error_output, to_wire

log = get_logger("worker")


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """Redis side of an engine worker."""

    engine_id: str
    model_name: str
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_prefix: str = DEFAULT_PREFIX
    metrics_host: str = "0.0.0.0"
    metrics_port: int | None = None
    heartbeat_interval_s: float = 1.0
    claim_after_s: float | None = None  # default: 5 heartbeat intervals
    progress_ttl_s: int = 3600
    max_pull: int = 64
    idle_block_ms: int = 500

    @property
    def claim_after_ms(self) -> int:
        return int(1000 * (self.claim_after_s or 5 * self.heartbeat_interval_s))


class EngineWorker:
    """One engine serving the request stream as consumer `engine_id` of group `engines`."""

    def __init__(self, config: WorkerConfig, engine_config: EngineConfig) -> None:
        self.config = config
        self.engine_config = engine_config
        self.keys = Keys(config.redis_prefix)
        self.thread = EngineThread()
        self.stop = asyncio.Event()
        self.stats: dict[str, Any] = {}
        self.metrics: EngineMetrics | None = None

    async def run(self) -> None:
        """Load the model, then serve until `stop` is set."""
        await self.thread.start(self.engine_config)
        engine = self.thread.engine
        client = aioredis.Redis.from_url(self.config.redis_url, health_check_interval=10)
        self.metrics = EngineMetrics(engine.device.type)
        stream = RequestStream(client, self.keys, self.config.engine_id)
        intake = Intake(client, self.keys, stream)
        beat = Heartbeat(client, self.keys, self.config.engine_id, self.config.model_name, str(engine.config.model),
                         engine.max_model_len, ttl_s=self.config.claim_after_ms / 1000)
        runner = None
        tasks: list[asyncio.Task[None]] = []
        try:
            await stream.ensure_group()
            if self.config.metrics_port is not None:
                runner = await start_metrics_server(self.metrics, self.config.metrics_host, self.config.metrics_port)
            await intake.admit(await stream.read_own_pending(), claimed=True)
            await self._beat(beat, intake)
            tasks = [asyncio.create_task(intake.listen_aborts(), name="aborts"),
                     asyncio.create_task(self._maintain(beat, intake), name="maintenance")]
            log.info("engine serving", engine_id=self.config.engine_id, model=self.config.model_name,
                     stream=self.keys.requests)
            await self._loop(client, intake)
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError, RedisError, OSError):
                    await task
            with contextlib.suppress(RedisError, OSError):
                await beat.remove()
            if runner is not None:
                await runner.cleanup()
            await client.aclose()
            self.thread.close()

    # ----- the main loop -----------------------------------------------------------------------
    async def _loop(self, client: aioredis.Redis, intake: Intake) -> None:
        """Steps run on the engine thread; the loop publishes one step while the next runs::

            engine thread   | step N        | step N+1        | step N+2  ...
            event loop      pull ─┘ publish N (MULTI/EXEC) ─┘ publish N+1 ...

        After step N returns, its outputs go to an outbox, new entries are pulled, and step
        N+1 starts before the outbox of N is flushed, so Redis round trips hide behind the
        model. Step N+1 never needs N's publish: the engine holds the tokens itself. When
        nothing is left to run, the loop blocks on XREADGROUP instead of spinning."""
        step: asyncio.Future[StepResult] | None = None
        while not self.stop.is_set() or step is not None:
            if step is None:
                if not self._busy(intake):
                    await self._pull(intake, block=True)
                    if not self._busy(intake):
                        await self._flush(client, intake.pending)
                        intake.pending = Outbox()
                        continue
                step = asyncio.ensure_future(self.thread.call(self.thread.step, *intake.take_jobs()))
            result = await step
            self.stats = result.stats
            assert self.metrics is not None
            self.metrics.update(result.stats)
            outbox, intake.pending = intake.pending, Outbox()
            self._collect(intake, result, outbox)
            step = None
            if not self.stop.is_set():
                await self._pull(intake, block=False)
                if self._busy(intake):  # overlap: next step computes while this one is published
                    step = asyncio.ensure_future(self.thread.call(self.thread.step, *intake.take_jobs()))
            await self._flush(client, outbox)

    def _busy(self, intake: Intake) -> bool:
        s = self.stats
        queued = s.get("running", 0) + s.get("waiting", 0) + s.get("swapped", 0)
        return bool(queued or intake.jobs or intake.aborts)

    async def _pull(self, intake: Intake, block: bool) -> None:
        if self.stop.is_set():
            return
        s = self.stats
        room = self.engine_config.max_num_seqs - s.get("running", 0) - len(intake.jobs)
        count = min(self.config.max_pull, room) if s.get("waiting", 0) == 0 else 0
        try:
            await intake.pull(count, self.config.idle_block_ms if block else None)
        except (RedisError, OSError) as exc:
            log.warning("cannot read the request stream", error=str(exc))
            await asyncio.sleep(0.5)

    def _collect(self, intake: Intake, result: StepResult, outbox: Outbox) -> None:
        """Engine deltas, rejections and aborts → wire messages, acks and metrics."""
        now = time.time()
        for request_id, message in result.rejected.items():
            tracked = intake.tracked.pop(request_id)
            outbox.add(tracked.gateway, error_output(tracked, message, "invalid_request_error", "invalid_parameter"))
            outbox.end(request_id, tracked.entry_id)
        for request_id in result.aborted:
            aborted = intake.tracked.pop(request_id, None)
            if aborted is not None:
                outbox.end(request_id, aborted.entry_id)
        for out in result.outputs:
            live = intake.tracked.get(out.request_id)
            if live is None:
                continue
            outbox.add(live.gateway, to_wire(live, out))
            if out.finished:
                intake.tracked.pop(out.request_id)
                outbox.end(out.request_id, live.entry_id)
                if self.metrics is not None and out.error is None:
                    self.metrics.observe_finished(live.request.arrival, live.first_token_at, now,
                                                  out.num_generated_tokens)

    async def _flush(self, client: aioredis.Redis, outbox: Outbox) -> None:
        try:
            await flush(client, self.keys, outbox, self.config.progress_ttl_s)
        except (RedisError, OSError) as exc:
            log.error("could not publish outputs", error=str(exc), requests=sum(map(len, outbox.by_gateway.values())))

    # ----- side tasks --------------------------------------------------------------------------
    async def _maintain(self, beat: Heartbeat, intake: Intake) -> None:
        """Every heartbeat interval: heartbeat, touch own entries, claim dead engines' entries."""
        interval = self.config.heartbeat_interval_s
        while True:
            last = time.monotonic()
            await asyncio.sleep(interval)
            if time.monotonic() - last > 2 * interval:
                log.warning("event loop starved", late_s=round(time.monotonic() - last - interval, 2))
            try:
                await intake.touch()  # first: it does not wait for the engine thread
                await self._beat(beat, intake)
                if not self.stop.is_set():
                    await intake.claim(self.config.claim_after_ms)
            except (RedisError, OSError) as exc:
                log.warning("maintenance failed", error=str(exc))

    async def _beat(self, beat: Heartbeat, intake: Intake) -> None:
        stats, pool = await self.thread.call(self.thread.snapshot)
        await beat.beat(stats, pool, {"in_flight": float(len(intake.tracked))})
