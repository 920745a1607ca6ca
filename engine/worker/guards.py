"""Checks an engine worker runs around every step, so it never works for nobody and never
publishes what it no longer owns:

- deadlines: a request past its deadline is aborted with a timeout error;
- gone gateways: a request whose gateway's liveness key stayed missing for `gateway_grace_s`
  is dropped (its client is gone with the gateway);
- ownership: after the heartbeat may have lapsed (a frozen process), the requests other
  engines took over are dropped before anything is published;
- the dataset epoch: when Redis lost its data (restart without persistence) every in-flight
  request is gone from Redis, so the engine drops them all and starts clean."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from common.log import get_logger
from engine.worker.intake import Intake

log = get_logger("worker.guards")


@dataclass(slots=True)
class Guards:
    """Per-step checks on an intake's tracked requests."""

    intake: Intake
    gateway_grace_s: float = 3.0
    missing_since: dict[str, float] = field(default_factory=dict)

    def expire(self, now: float | None = None) -> list[str]:
        """Abort requests past their deadline, with a timeout error for their clients."""
        now = time.time() if now is None else now
        late = [t.request_id for t in self.intake.tracked.values()
                if t.request.deadline is not None and now > t.request.deadline]
        for request_id in late:
            self.intake.fail(request_id, "request deadline passed", "timeout", "timeout")
        if late:
            log.warning("requests past their deadline aborted", count=len(late))
        return late

    def gateways_to_probe(self, limit: int = 64) -> list[str]:
        return sorted({t.gateway for t in self.intake.tracked.values()})[:limit]

    def on_probe(self, alive: dict[str, bool], now: float | None = None) -> list[str]:
        """Record which gateways answered; drop the requests of one gone for the grace period."""
        now = time.monotonic() if now is None else now
        gone: list[str] = []
        for gateway, present in alive.items():
            if present:
                self.missing_since.pop(gateway, None)
                continue
            since = self.missing_since.setdefault(gateway, now)
            if now - since >= self.gateway_grace_s:
                gone.append(gateway)
        dropped: list[str] = []
        for gateway in gone:
            self.missing_since.pop(gateway, None)
            ids = [t.request_id for t in self.intake.tracked.values() if t.gateway == gateway]
            dropped += self.intake.end(ids)
            log.warning("gateway gone: its requests aborted", gateway=gateway, requests=len(ids))
        return dropped

    def lose(self, request_ids: set[str], why: str) -> None:
        """Requests this engine must stop without touching Redis for them (not ours any more)."""
        if request_ids:
            self.intake.lose(request_ids)
            log.warning("requests dropped", why=why, count=len(request_ids))
