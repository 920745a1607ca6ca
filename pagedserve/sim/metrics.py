"""Per-step figures of one simulated policy, and the summary the simulator reports.

Ratios over time are byte-time weighted (sum over steps of the numerator / sum of the
denominator), so a nearly empty tail of the run does not swamp the busy middle. Utilization is
tokens / reserved; internal fragmentation is the reserved slots that will never hold a token
(paged: the unused slots of partly filled blocks; contiguous: beyond the final length);
reservation waste the reserved slots that hold a token only later (contiguous only); external
fragmentation the free memory in holes too small for the request waiting at the head of the
queue, as a share of the pool (paged: none, any free block serves any sequence).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from pagedserve.sim.types import MemoryState


@dataclass(slots=True)
class PolicyResult:
    """What one policy did with the trace (token slots unless named otherwise)."""

    name: str
    kind: str
    block_size: int
    sharing: bool
    capacity_tokens: int
    steps: int = 0
    finished: int = 0
    rejected: int = 0
    preemptions: int = 0
    cow_copies: int = 0
    prefix_hit_tokens: int = 0
    blocked_by_fragmentation: int = 0
    max_concurrency: int = 0
    mean_concurrency: float = 0.0
    utilization: float = 0.0
    reservation_waste: float = 0.0
    internal_fragmentation: float = 0.0
    external_fragmentation: float = 0.0
    pool_usage: float = 0.0
    mean_reserved_tokens: float = 0.0
    reserved_per_seq: float = 0.0
    sharing_saving: float = 0.0
    series: dict[str, list[float]] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        """Everything but the time series."""
        return {k: v for k, v in asdict(self).items() if k != "series"}


class StepRecorder:
    """Accumulates one policy's memory and concurrency step by step."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.steps: list[int] = []
        self.running: list[int] = []
        self.utilization: list[float] = []
        self.pool_usage: list[float] = []
        self._sums = dict.fromkeys(("tokens", "reserved", "future", "external", "logical", "seqs"), 0)

    def record(self, step: int, num_seqs: int, mem: MemoryState) -> None:
        self.steps.append(step)
        self.running.append(num_seqs)
        previous = self.utilization[-1] if self.utilization else 0.0
        self.utilization.append(mem.tokens / mem.reserved if mem.reserved else previous)  # empty: no change
        self.pool_usage.append(mem.reserved / self.capacity)
        sums = self._sums
        sums["tokens"] += mem.tokens
        sums["reserved"] += mem.reserved
        sums["future"] += mem.future
        sums["external"] += mem.unusable_free
        sums["logical"] += mem.logical
        sums["seqs"] += num_seqs

    def fill(self, result: PolicyResult, max_points: int = 400) -> None:
        """Write the summary figures and a downsampled time series into `result`."""
        n, sums = len(self.steps), self._sums
        reserved = sums["reserved"] or 1
        result.max_concurrency = max(self.running, default=0)
        result.mean_concurrency = sums["seqs"] / n if n else 0.0
        result.utilization = sums["tokens"] / reserved
        result.reservation_waste = sums["future"] / reserved
        result.internal_fragmentation = (sums["reserved"] - sums["tokens"] - sums["future"]) / reserved
        result.external_fragmentation = sums["external"] / (self.capacity * n) if n else 0.0
        result.pool_usage = sums["reserved"] / (self.capacity * n) if n else 0.0
        result.mean_reserved_tokens = sums["reserved"] / n if n else 0.0
        result.reserved_per_seq = sums["reserved"] / sums["seqs"] if sums["seqs"] else 0.0
        result.sharing_saving = 1 - sums["reserved"] / sums["logical"] if sums["logical"] else 0.0
        stride = max(1, n // max_points)
        result.series = {
            "step": [float(s) for s in self.steps[::stride]],
            "running": [float(r) for r in self.running[::stride]],
            "utilization": self.utilization[::stride],
            "pool_usage": self.pool_usage[::stride],
        }
