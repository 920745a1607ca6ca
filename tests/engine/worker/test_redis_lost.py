"""After Redis lost its data, the engine's clean-up talks to a server that has just come back:
pooled connections may still point at the old one. A failure there must not stop the engine
(it did once: the epoch check raised "Connection closed by server" and the engine exited), and
the epoch the flush read is adopted, so later requests are not dropped a second time."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from common.ports import free_port
from engine.config import EngineConfig
from engine.worker.engine_worker import EngineWorker, WorkerConfig
from engine.worker.failover import Failover
from engine.worker.intake import Intake
from engine.worker.request_stream import RequestStream


def test_redis_lost_survives_a_server_that_is_not_back_yet() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there: every command fails
    worker = EngineWorker(WorkerConfig(engine_id="eng-x", model_name="m", redis_url=url),
                          EngineConfig(model="unused"))
    worker.epoch.token = "old"

    async def run() -> None:
        client = aioredis.Redis.from_url(url, socket_connect_timeout=0.5)
        try:
            stream = RequestStream(client, worker.keys, "m", "eng-x")
            intake = Intake(client, worker.keys, stream, "m", epoch=worker.epoch)
            failover = Failover(client, intake, worker.recovery, worker.epoch)
            await failover.redis_lost("new")
            assert worker.epoch.token == "new"
            await failover.redis_lost(None)  # no token seen: keep the one adopted
            assert worker.epoch.token == "new"
        finally:
            await client.aclose()

    asyncio.run(run())
