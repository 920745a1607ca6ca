"""What the scheduler needs from a speculative proposer (`engine.spec.speculator.Speculator`
implements it; the scheduler only asks and reports, so it does not import the spec package)."""

from __future__ import annotations

from typing import Protocol

from engine.sched.sequence import Sequence


class Proposer(Protocol):
    def allows_batch(self, num_running_seqs: int) -> bool:
        """Whether a step batching this many sequences may propose at all."""
        ...

    def propose(self, seq: Sequence, limit: int) -> list[int]:
        """Up to `limit` proposed tokens following `seq.token_ids` ([] for none)."""
        ...

    def record(self, seq: Sequence, num_proposed: int, num_accepted: int) -> None:
        """One verified row's outcome."""
        ...

    def release(self, seq: Sequence) -> None:
        """Forget a finished or aborted sequence (a proposer may keep its output)."""
        ...
