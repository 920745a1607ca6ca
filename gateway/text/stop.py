"""Stop strings across token boundaries: hold back text that may be the start of a stop."""

from __future__ import annotations


class StopMatcher:
    """Feed text deltas; get back text safe to emit and whether a stop string matched.

    The stop string itself is not emitted (OpenAI behaviour)."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self._held = ""
        self.matched: str | None = None

    def feed(self, text: str) -> str:
        """Return the emittable part of `held + text`; sets `matched` on a stop string."""
        if self.matched is not None:
            return ""
        if not self.stops:
            return text
        buf = self._held + text
        hits = [(buf.find(s), s) for s in self.stops]
        found = [(i, s) for i, s in hits if i >= 0]
        if found:
            index, stop = min(found)
            self.matched, self._held = stop, ""
            return buf[:index]
        keep = self._partial_suffix(buf)
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep]

    def flush(self) -> str:
        """End of generation: the held-back text was not a stop after all."""
        held, self._held = self._held, ""
        return "" if self.matched is not None else held

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that is a proper prefix of some stop."""
        best = 0
        for stop in self.stops:
            for length in range(min(len(stop) - 1, len(buf)), best, -1):
                if buf.endswith(stop[:length]):
                    best = length
                    break
        return best
