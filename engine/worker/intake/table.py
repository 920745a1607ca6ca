"""The table of requests this engine serves, what waits for the engine thread (jobs to add,
aborts), and the outbox of what admission, drops and failures produce between two steps."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType

from engine.outputs import RequestOutput
from engine.worker.engine_thread import AddJob, StepResult
from engine.worker.outbox import Outbox
from engine.worker.tracked import Tracked, error_output, to_wire


class RequestTable:
    """The requests this engine serves (`tracked`, read-only to everyone else), the jobs and aborts
    for the next engine step, and the pending outbox (`take_pending`). Every change to any of them
    goes through a method here."""

    def __init__(self) -> None:
        self._tracked: dict[str, Tracked] = {}
        self.tracked: Mapping[str, Tracked] = MappingProxyType(self._tracked)
        self.jobs: list[AddJob] = []
        self.aborts: set[str] = set()
        self.forced_aborts: set[str] = set()  # already ended here; the engine must still drop them
        self._pending = Outbox()  # errors and acks produced between two steps

    @property
    def has_work(self) -> bool:
        """Jobs or aborts wait for the engine thread."""
        return bool(self.jobs or self.aborts or self.forced_aborts)

    @property
    def is_empty(self) -> bool:
        """Nothing tracked, nothing to tell the engine, nothing to publish."""
        return not (self._tracked or self.forced_aborts or self._pending)

    @property
    def pending(self) -> Outbox:
        """The outbox being filled until the next `take_pending` (admission adds its errors and acks)."""
        return self._pending

    def take_pending(self) -> Outbox:
        """What was produced since the last call, to publish with the next step's outputs."""
        pending, self._pending = self._pending, Outbox()
        return pending

    def track(self, tracked: Tracked, job: AddJob) -> None:
        """Serve an admitted request: the engine adds `job` at its next step."""
        self._tracked[tracked.request_id] = tracked
        self.jobs.append(job)

    def abort(self, request_id: str) -> bool:
        """Stop a tracked request at the next step; False when it is not tracked."""
        if request_id not in self._tracked:
            return False
        self.aborts.add(request_id)
        return True

    def fail(self, request_id: str, message: str, type_: str, code: str) -> None:
        """End a tracked request with an error for its client (the engine drops it next step)."""
        for tracked in self.drop([request_id]):
            self._pending.add(tracked.gateway, error_output(tracked, message, type_, code))
            self._pending.end(request_id, tracked.entry_id, tracked.stream, tracked.gateway)

    def end(self, request_ids: list[str]) -> list[str]:
        """Stop serving these requests without a message (their client is gone): acknowledge
        their entries; returns those that were tracked."""
        dropped = self.drop(request_ids)
        for tracked in dropped:
            self._pending.end(tracked.request_id, tracked.entry_id, tracked.stream, tracked.gateway)
        return [t.request_id for t in dropped]

    def lose(self, request_ids: set[str]) -> None:
        """Requests this engine no longer owns: stop them and publish nothing for them."""
        self.drop(sorted(request_ids))
        self._pending = self._pending.without(request_ids)

    def forget_all(self) -> set[str]:
        """Redis lost its data: drop every request, and the checkpoints written since the loss."""
        lost = set(self._tracked)
        dropped = self.drop(sorted(lost))
        self._pending = Outbox(forget_progress=sorted(lost), gateway_of={t.request_id: t.gateway for t in dropped})
        return lost

    def hand_back(self, outbox: Outbox) -> int:
        """Put every tracked request back on the stream (`handoffs` + 1, so its next engine
        resumes it from its checkpoint) and acknowledge our entries; returns how many."""
        dropped = self.drop(list(self._tracked))
        for tracked in dropped:
            again = dataclasses.replace(tracked.request, handoffs=tracked.request.handoffs + 1)
            outbox.requeue.append(again.encode())
            outbox.ack(tracked.entry_id, tracked.stream)
        return len(dropped)

    def collect(self, result: StepResult, outbox: Outbox) -> list[tuple[Tracked, RequestOutput]]:
        """One step's deltas, refusals, failures and aborts → wire messages and acks in `outbox`;
        returns the requests that finished cleanly with their last delta (for metrics)."""
        for request_id, (message, code) in result.rejected.items():
            self._end_with(outbox, request_id, message, "invalid_request_error", code)
        for request_id, message in result.failed.items():
            self._end_with(outbox, request_id, message, "server_error", "engine_step_failed")
        for request_id in result.aborted:
            aborted = self._tracked.pop(request_id, None)
            if aborted is not None:
                outbox.end(request_id, aborted.entry_id, aborted.stream, aborted.gateway)
        finished = []
        for out in result.outputs:
            live = self._tracked.get(out.request_id)
            if live is None:
                continue
            outbox.add(live.gateway, to_wire(live, out))
            if out.finished:
                del self._tracked[out.request_id]
                outbox.end(out.request_id, live.entry_id, live.stream)
                if out.error is None:
                    finished.append((live, out))
        return finished

    def _end_with(self, outbox: Outbox, request_id: str, message: str, type_: str, code: str) -> None:
        tracked = self._tracked.pop(request_id, None)
        if tracked is not None:
            outbox.add(tracked.gateway, error_output(tracked, message, type_, code))
            outbox.end(request_id, tracked.entry_id, tracked.stream, tracked.gateway)

    def take_jobs(self) -> tuple[list[AddJob], list[str]]:
        """Jobs and aborts for the next engine step; aborted jobs never reach the engine."""
        aborts, self.aborts = self.aborts, set()
        forced, self.forced_aborts = self.forced_aborts, set()
        jobs = [job for job in self.jobs if job.request_id not in aborts and job.request_id not in forced]
        for job in self.jobs:
            if job.request_id in aborts:
                tracked = self._tracked.pop(job.request_id)
                self._pending.end(job.request_id, tracked.entry_id, tracked.stream, tracked.gateway)
        queued = {job.request_id for job in self.jobs}
        self.jobs = []
        return jobs, [rid for rid in aborts if rid in self.tracked] + [rid for rid in forced if rid not in queued]

    def drop(self, request_ids: list[str]) -> list[Tracked]:
        """Stop tracking these requests (the engine drops them at its next step); returns them."""
        dropped = [t for t in (self._tracked.pop(rid, None) for rid in request_ids) if t is not None]
        self.forced_aborts.update(t.request_id for t in dropped)
        return dropped
