"""Aborts from the abort channel: a tracked request stops at the next engine step; an id this
engine does not track yet is remembered for a while, since its entry may still be queued."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

import redis.asyncio as aioredis

from common.log import get_logger
from common.protocol import AbortMessage, Keys, ProtocolError
from common.pubsub import subscribe_forever
from engine.worker.intake.table import RequestTable

log = get_logger("worker.intake")
ABORT_MEMORY_S = 300.0
MAX_REMEMBERED_ABORTS = 100_000


class Aborts:
    """Listens on the abort channel for `model`'s requests and applies them to `table`."""

    def __init__(self, client: aioredis.Redis, keys: Keys, model: str, table: RequestTable) -> None:
        self.client = client
        self.keys = keys
        self.model = model
        self.table = table
        self.recent: OrderedDict[str, float] = OrderedDict()  # id -> when, oldest first
        self.bad = 0  # undecodable abort messages (metric)

    def recently_aborted(self, request_id: str) -> bool:
        """An abort for this id came before its entry did: admission acknowledges it unserved."""
        return request_id in self.recent

    def on_abort(self, ids: list[str]) -> None:
        """Stop tracked requests at the next step; remember the others for `ABORT_MEMORY_S`
        (their entry may still be queued) in insertion order, so expiry is O(1) per id."""
        now = time.monotonic()
        for request_id in ids:
            if not self.table.abort(request_id):
                self.recent.pop(request_id, None)
                self.recent[request_id] = now
        while self.recent and (len(self.recent) > MAX_REMEMBERED_ABORTS
                               or next(iter(self.recent.values())) < now - ABORT_MEMORY_S):
            self.recent.popitem(last=False)

    def _on_message(self, data: bytes) -> None:
        try:
            message = AbortMessage.decode(data)
        except ProtocolError as exc:
            self.bad += 1
            log.warning("undecodable abort message ignored", error=str(exc)[:200])
            return
        if not message.model or message.model == self.model:
            self.on_abort(message.ids)

    async def listen(self, running: Callable[[], bool] = lambda: True) -> None:
        """Run while `running()`: the abort channel (resubscribing after errors)."""
        await subscribe_forever(self.client, self.keys.abort, self._on_message, running=running)
