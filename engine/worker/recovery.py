"""The worker's recovery state, in one owner: what a failed flush left to send again
(`unsent`), the progress-checkpoint log (`checkpoints`), whether this engine must look again
at what it owns after Redis trouble (readopt due), and whether the heartbeat wants a fresh
pool snapshot from the next step.

The worker's tasks (the main loop, the heartbeat, the intake's data-loss callback) and the
engine thread ask this object; none writes these fields itself, so each has one writer.

Thread-safety: one `threading.Lock` guards every field, and every method holds it for its
whole (short, non-blocking) body, so each method is atomic from any thread. The outbox and
the log are only used on the event loop; the snapshot request is the one piece crossing
threads (asked for on the loop, taken on the engine thread). A `take_*` method tests and
clears in one step: two notes before a take give one action, a note after a take gives
another."""

from __future__ import annotations

import threading

from engine.worker.checkpoints import CheckpointLog
from engine.worker.outbox import Outbox


class RecoveryState:
    """Unsent outputs, checkpoint log, readopt-due and snapshot-wanted flags (see the module)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._unsent = Outbox()  # outboxes whose flush failed (or a replica did not confirm), retried first
        self._checkpoints = CheckpointLog()  # keeps each request's progress list bounded
        self._readopt_due = False  # Redis failed us since the last check of what we own (`Intake.readopt`)
        self._snapshot_wanted = True  # the next step refreshes pool and block tables

    # ----- unsent outputs and checkpoints ------------------------------------------------------
    def note_unsent(self, outbox: Outbox) -> Outbox:
        """Queue `outbox` behind what is still unsent; returns everything to flush now."""
        with self._lock:
            self._unsent.merge(outbox)
            return self._unsent

    @property
    def unsent(self) -> Outbox:
        """What is still to send (read-only to callers)."""
        with self._lock:
            return self._unsent

    @property
    def has_unsent(self) -> bool:
        with self._lock:
            return bool(self._unsent)

    @property
    def checkpoints(self) -> CheckpointLog:
        """The log flushes plan their checkpoint writes with (replaced whole on data loss)."""
        with self._lock:
            return self._checkpoints

    def sent(self, outbox: Outbox) -> None:
        """`outbox` (as returned by `unsent`) was flushed: nothing is left unsent, unless it was
        replaced meanwhile (a data loss or lost ownership during the flush: the replacement stays)."""
        with self._lock:
            if self._unsent is outbox:
                self._unsent = Outbox()

    def lose(self, request_ids: set[str]) -> None:
        """These requests are no longer ours: publish nothing and checkpoint nothing for them."""
        if not request_ids:
            return
        with self._lock:
            self._unsent = self._unsent.without(request_ids)
            self._checkpoints.forget(request_ids)

    def data_lost(self) -> None:
        """Redis lost its data: every unsent output and every checkpoint count is void."""
        with self._lock:
            self._unsent = Outbox()
            self._checkpoints = CheckpointLog(self._checkpoints.max_entries)

    # ----- readopt -----------------------------------------------------------------------------
    def note_redis_trouble(self) -> None:
        """A Redis call failed (or a write was not confirmed): check what we own once it answers."""
        with self._lock:
            self._readopt_due = True

    @property
    def readopt_due(self) -> bool:
        with self._lock:
            return self._readopt_due

    def take_readopt(self) -> bool:
        """True once per run of troubles: the caller readopts now (and notes trouble again when
        that fails)."""
        with self._lock:
            due, self._readopt_due = self._readopt_due, False
            return due

    # ----- pool snapshots ----------------------------------------------------------------------
    def request_snapshot(self) -> None:
        """The heartbeat sent the cached snapshot: the next step takes a fresh one."""
        with self._lock:
            self._snapshot_wanted = True

    def take_snapshot(self) -> bool:
        """True when a snapshot was asked for since the last take (the engine thread takes it)."""
        with self._lock:
            wanted, self._snapshot_wanted = self._snapshot_wanted, False
            return wanted
