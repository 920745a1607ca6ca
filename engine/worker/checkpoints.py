"""The size bound of progress checkpoints (`{prefix}:progress:<id>`, one RPUSH per step): the
engine folds what it has written for each request, and once a request holds `max_entries` of
its entries the next flush replaces them with one snapshot entry (LTRIM of this engine's tail,
then RPUSH, in the flush's MULTI). So a list holds at most `max_entries` entries per engine that
ran the request (earlier engines' entries, read at resume, are left alone), and its bytes grow
with the tokens (about 3 bytes each), not with the steps; resume folds it to the same tokens.

Counts change only once a flush is written; a repeated flush (a lost reply, a replica that did not
confirm) can only leave extra entries of ours before the snapshot, which fold to the same tokens
because folding de-duplicates by offset."""

from __future__ import annotations

from dataclasses import dataclass, field

from common.protocol import OutputMessage, Progress

CHECKPOINT_ENTRIES = 32  # this engine's entries per request before they are folded into one


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """One message's checkpoint write: drop this engine's last `trim` entries first (0: none),
    then push `entry`; the list then ends with `entries_after` entries of this engine."""

    entry: bytes
    trim: int
    entries_after: int


@dataclass(slots=True)
class _Written:
    progress: Progress = field(default_factory=Progress)
    entries: int = 0  # this engine's entries at the end of the request's list, as last flushed


class CheckpointLog:
    """Per request: the progress this engine has checkpointed, and how many entries that took."""

    def __init__(self, max_entries: int = CHECKPOINT_ENTRIES) -> None:
        if max_entries < 2:
            raise ValueError("max_entries must be at least 2")
        self.max_entries = max_entries
        self._requests: dict[str, _Written] = {}

    def plan(self, message: OutputMessage, entries: int | None = None) -> Checkpoint:
        """The write for `message`, given this engine's `entries` in the list before it (default:
        as last flushed; pass the previous plan's `entries_after` for a second message in a flush)."""
        written = self._requests.setdefault(message.id, _Written())
        checkpoint = message.checkpoint()
        written.progress.fold(checkpoint, open_start=True)
        before = written.entries if entries is None else entries
        if before + 1 <= self.max_entries:
            return Checkpoint(checkpoint.encode(), 0, before + 1)
        return Checkpoint(written.progress.snapshot(message.id).encode(), before, 1)

    def written(self, entries_after: dict[str, int]) -> None:
        """A flush with these plans was written."""
        for request_id, entries in entries_after.items():
            if request_id in self._requests:
                self._requests[request_id].entries = entries

    def forget(self, request_ids: set[str]) -> None:
        """These requests' lists were deleted (ended) or are no longer ours."""
        for request_id in request_ids:
            self._requests.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._requests)
