"""Re-adoption after a Redis failover: the new master may lack the last writes the old one
acknowledged (a finished request's XACK/XDEL, an XREADGROUP's reply), which leaves entries
pending under this engine that it does not track, there for good unless it looks."""

from __future__ import annotations

from common.log import get_logger
from engine.worker.intake.admission import Admission
from engine.worker.intake.sources import Sources
from engine.worker.intake.table import RequestTable

log = get_logger("worker.intake")


class Readopt:
    """Finds this engine's untracked pending entries on its own streams and admits them again."""

    def __init__(self, table: RequestTable, admission: Admission, sources: Sources) -> None:
        self.table = table
        self.admission = admission
        self.sources = sources
        self.readopted = 0  # own entries found pending but untracked after Redis trouble (metric)

    async def run(self) -> int:
        """Resume (or just acknowledge) entries pending under this engine that it does not track.
        Resuming goes by the request's checkpoint (one whose client got everything is only
        acknowledged; the gateway drops repeated output). Returns how many were found."""
        shared = self.sources.stream.key
        async with self.admission.lock:
            acking = self.table.pending.acks(shared)
            found = 0
            for stream in self.sources.own_streams:
                known = {t.entry_id for t in self.table.tracked.values() if (t.stream or shared) == stream.key}
                known |= set(acking.get(stream.key, []))
                orphans = await stream.own_pending_except(known)
                if orphans:
                    log.warning("untracked entries pending under this engine: resuming them", count=len(orphans),
                                stream=stream.key)
                    self.readopted += len(orphans)
                    for e in map(self.admission.local, orphans):
                        if e.payload is None:
                            self.table.pending.ack(e.entry_id, e.stream)
                    await self.admission.admit_held([e for e in orphans if e.payload is not None], claimed=True)
                found += len(orphans)
            return found
