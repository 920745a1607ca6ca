"""What flows into an engine worker, by concern:

- `table`: the requests this engine serves, the jobs and aborts for the next step, and the
  outbox of what admission, drops and failures produce;
- `sources`: new entries, own routed stream first, then the shared one, and work stealing;
- `admission`: entries → tracked requests and jobs (resumed from their checkpoints), dead letters;
- `takeover`: entries of dead engines of the same model;
- `readopt`: entries left pending under this engine after a Redis failover;
- `aborts`: the abort channel.

`Intake` is the table with these parts around it, built complete in its constructor. May import
redis, `common` and the worker's own modules below it (`engine_thread`, `outbox`,
`request_stream`, `tracked`)."""

from __future__ import annotations

from collections.abc import Callable

import redis.asyncio as aioredis

from common.protocol import Keys
from common.redis_conn import Epoch
from engine.worker.intake.aborts import Aborts
from engine.worker.intake.admission import Admission
from engine.worker.intake.readopt import Readopt
from engine.worker.intake.sources import Sources
from engine.worker.intake.table import RequestTable
from engine.worker.intake.takeover import Takeover
from engine.worker.request_stream import RequestStream, StreamEntry

__all__ = ["Intake"]


class Intake(RequestTable):
    """The table of requests this engine serves (`RequestTable`: `tracked` is read-only to everyone
    else) fed by its sources, takeovers, re-adoption and the abort channel. `on_data_lost` hears
    which requests were dropped when Redis lost its data. The gateway counters are written by
    `Guards` alone."""

    def __init__(self, client: aioredis.Redis, keys: Keys, stream: RequestStream, model: str,
                 max_claims: int = 3, epoch: Epoch | None = None,
                 on_data_lost: Callable[[set[str]], None] | None = None, routed: RequestStream | None = None,
                 steal_after_ms: int | None = None) -> None:
        super().__init__()
        self.client = client
        self.keys = keys
        self.stream = stream
        self.model = model
        self.on_data_lost = on_data_lost
        self.abort_channel = Aborts(client, keys, model, self)
        self.admission = Admission(client, keys, model, stream, self, self.abort_channel, max_claims, epoch,
                                   on_data_lost=self.data_lost)
        self.sources = Sources(client, keys, model, stream, self.admission, routed, steal_after_ms)
        self.takeover = Takeover(client, keys, model, self.sources, self.admission)
        self.readopter = Readopt(self, self.admission, self.sources)
        self.gateway_gone = 0  # requests ended: their gateway's liveness key stayed gone past the grace (metric)
        self.gateway_restarted = 0  # requests ended: their gateway restarted under the same id (metric)
        self.gateways_missing = 0  # gateways of tracked requests whose liveness key is gone, within the grace

    @property
    def routed(self) -> RequestStream | None:
        """This engine's own routed stream; None: no routing."""
        return self.sources.routed

    @property
    def own_streams(self) -> list[RequestStream]:
        return self.sources.own_streams

    def stream_for(self, key: str) -> RequestStream:
        return self.sources.stream_for(key)

    def counters(self) -> dict[str, float]:
        """What the intake refused so far (for metrics and heartbeats)."""
        return {"dead_lettered": float(self.admission.dead_lettered), "bad_aborts": float(self.abort_channel.bad),
                "readopted": float(self.readopter.readopted), "in_flight": float(len(self.tracked)),
                "routed_taken": float(self.sources.routed_taken), "stolen": float(self.sources.stolen),
                "gateway_gone_aborted": float(self.gateway_gone),
                "gateway_restart_aborted": float(self.gateway_restarted),
                "gateways_missing": float(self.gateways_missing)}

    async def admit(self, entries: list[StreamEntry], claimed: bool) -> None:
        await self.admission.admit(entries, claimed)

    async def pull(self, count: int, block_ms: int | None) -> int:
        return await self.sources.pull(count, block_ms)

    async def claim(self, min_idle_ms: int, rounds: int = 10) -> int:
        return await self.takeover.claim(min_idle_ms, rounds)

    async def readopt(self) -> int:
        return await self.readopter.run()

    async def listen_aborts(self, running: Callable[[], bool] = lambda: True) -> None:
        await self.abort_channel.listen(running)

    def data_lost(self) -> set[str]:
        """Redis lost its data: drop every request (`forget_all`), then tell `on_data_lost` which."""
        lost = self.forget_all()
        if self.on_data_lost is not None:
            self.on_data_lost(lost)
        return lost
