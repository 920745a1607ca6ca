"""Checks an engine worker runs around every step, so it never works for nobody and never
publishes what it no longer owns:

- deadlines: a request past its deadline is aborted with a timeout error;
- gone gateways: a request whose gateway's liveness key stayed missing for `gateway_grace_s`
  (default 30 s: a gateway paused or cut off from Redis for less loses nothing) is ended with
  an error record on that gateway's output stream (read by id: a gateway that comes back ends
  each client stream with an error event instead of waiting for tokens that will never come);
- restarted gateways: a request whose gateway token is not the one its gateway's key holds
  now came from an earlier process under the same id (killed and restarted): it is ended at
  once, its blocks freed (nobody reads its output any more);
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
GATEWAY_GRACE_S = 30.0  # how long a gateway's liveness key may stay gone before its requests end


@dataclass(slots=True)
class Guards:
    """Per-step checks on an intake's tracked requests."""

    intake: Intake
    gateway_grace_s: float = GATEWAY_GRACE_S
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

    def on_probe(self, alive: dict[str, str | None], now: float | None = None) -> list[str]:
        """Record which gateways answered (each probed gateway's liveness token, None when its key is
        gone): end the requests of a gateway gone for the grace period, and at once those whose
        token is not their gateway's live one. Each ended request gets an error record on its
        gateway's output stream. Returns the ended ids."""
        now = time.monotonic() if now is None else now
        ended: list[str] = []
        for gateway, token in alive.items():
            mine = [t for t in self.intake.tracked.values() if t.gateway == gateway]
            if token is not None:
                self.missing_since.pop(gateway, None)
                stale = [t.request_id for t in mine if t.request.gateway_token and t.request.gateway_token != token]
                if stale:
                    self._end(stale, f"this request's gateway '{gateway}' restarted (a new process under the same "
                                     "id); the engine stopped it", "gateway_restarted")
                    self.intake.gateway_restarted += len(stale)
                    log.warning("gateway restarted: its earlier process's requests aborted", gateway=gateway,
                                requests=len(stale))
                    ended += stale
                continue
            if gateway not in self.missing_since:
                log.warning("gateway's liveness key gone: its requests end unless it is back within the grace",
                            gateway=gateway, requests=len(mine), grace_s=self.gateway_grace_s)
            since = self.missing_since.setdefault(gateway, now)
            if now - since < self.gateway_grace_s:
                continue
            self.missing_since.pop(gateway, None)
            ids = [t.request_id for t in mine]
            self._end(ids, f"this request's gateway '{gateway}' could not reach Redis for more than "
                           f"{self.gateway_grace_s:g} s; the engine stopped it", "gateway_gone")
            self.intake.gateway_gone += len(ids)
            log.warning("gateway gone: its requests aborted", gateway=gateway, requests=len(ids),
                        grace_s=self.gateway_grace_s)
            ended += ids
        serving = {t.gateway for t in self.intake.tracked.values()}
        for gateway in [g for g in self.missing_since if g not in serving]:  # a later pause starts a fresh clock
            del self.missing_since[gateway]
        self.intake.gateways_missing = len(self.missing_since)
        return ended

    def _end(self, request_ids: list[str], message: str, code: str) -> None:
        for request_id in request_ids:
            self.intake.fail(request_id, message, "service_unavailable", code)

    def lose(self, request_ids: set[str], why: str) -> None:
        """Requests this engine must stop without touching Redis for them (not ours any more)."""
        if request_ids:
            self.intake.lose(request_ids)
            log.warning("requests dropped", why=why, count=len(request_ids))
