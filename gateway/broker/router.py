"""Cache-aware routing: which request stream a request goes to.

From the live heartbeats of the request's model, the engines that read their own stream
(`routed`, fresh within `fresh_s`, not `draining`) are candidates. For each, the match is the
number of leading prompt blocks (`common.block_hash.prefix_keys` by its block size) found in
its announced `cached` keys or in this gateway's own hints for it. Then:

- best match > 0 and load(best) <= load(least loaded) + `load_slack`: the best engine's stream
  (`prefix`);
- best match > 0 but that engine is loaded well above the least loaded: the least loaded
  engine's stream (`load`);
- no match anywhere: the least loaded engine's stream too (`load`: a placement, so the hint
  knows where the conversation's next turn should go before a heartbeat says so);
- no candidate (no engine reads a stream of its own, or all are draining or stale): the shared
  stream (`shared`), which any engine takes, as without routing.

A request for a LoRA adapter (`EngineRequest.lora_name`) has as candidates only the engines whose
heartbeat announces that adapter; its prefix keys chain from the adapter (`common.block_hash`).

Load is the requests this gateway has outstanding on the engine (routed there and not yet
`done`: exact and current) plus the others its last heartbeat counted (waiting + running, less
this gateway's requests outstanding there at the heartbeat's time: other gateways' requests);
an engine whose KV pool is at least `KV_FULL` used counts `load_slack` more. Ties go to the lower
engine id, so gateways with the same view agree. (The heartbeat alone is up to a second old: it
still counts requests that finished since and misses those queued but not yet read, and a turn
sent the moment its previous one ended then saw the engine busier than it was and went to the
other engine, without its history: run 3 of 2026-12-05's six, cached share 0.82.)

Hints: the prefix keys of each prompt sent to an engine, in a bounded LRU per model, count as
that engine's (a key may be hinted for several engines: conversations that open with the same
system prompt share their first blocks, and each engine keeps its own copy) until a heartbeat
announces them (then the heartbeat speaks for them), the engine stops being a candidate, or
`hint_ttl_s` passes (an unconfirmed hint was evicted or stolen). Each gateway builds the same
view from Redis; hints only make its own recent decisions visible sooner. Work stealing (engine
side) keeps a routed request from waiting longer than the shared stream would make it."""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from common.block_hash import prefix_keys
from common.protocol import EngineHeartbeat, Keys

KV_FULL = 0.95  # used share of the KV pool past which an engine counts as loaded
REASONS = ("prefix", "load", "shared")


@dataclass(frozen=True, slots=True)
class Route:
    """Where one request goes: `stream` (a routed stream or the shared one), the engine chosen
    (None for the shared stream), why, and how many leading blocks matched there."""

    stream: str
    engine_id: str | None
    reason: str
    matched_blocks: int = 0


@dataclass(slots=True)
class _Engine:
    """One candidate engine as of its last heartbeat."""

    engine_id: str
    block_size: int
    cached: frozenset[int]
    others: float  # the heartbeat's load less this gateway's requests there at its time (+ KV slack)
    beat_time: float
    loras: frozenset[str] = frozenset()  # the LoRA adapters it serves


@dataclass(slots=True)
class _ModelView:
    engines: dict[str, _Engine] = field(default_factory=dict)
    # prefix key -> {engine id: time.time() when a prompt holding it was sent there}
    hints: OrderedDict[int, dict[str, float]] = field(default_factory=OrderedDict)


def engine_load(beat: EngineHeartbeat, load_slack: float, own: float = 0.0) -> float:
    """Waiting + running requests less `own` (this gateway's, counted apart; never below 0), plus
    `load_slack` when the KV pool is nearly full."""
    stats = beat.stats
    load = max(0.0, stats.get("waiting", 0.0) + stats.get("running", 0.0) - own)
    return load + (load_slack if stats.get("usage_ratio", 0.0) >= KV_FULL else 0.0)


class Router:
    """Chooses a stream per request; `refresh` rebuilds the per-model view from heartbeats
    (call it with each new registry read: the cached-key sets are built once per refresh)."""

    def __init__(self, keys: Keys, load_slack: float = 4.0, fresh_s: float = 3.0, hint_size: int = 65536,
                 hint_ttl_s: float = 30.0) -> None:
        if load_slack < 0 or fresh_s <= 0 or hint_size < 0 or hint_ttl_s <= 0:
            raise ValueError("load_slack and hint_size must be >= 0, fresh_s and hint_ttl_s positive")
        self.keys = keys
        self.load_slack = load_slack
        self.fresh_s = fresh_s
        self.hint_size = hint_size
        self.hint_ttl_s = hint_ttl_s
        self.models: dict[str, _ModelView] = {}
        self.counts = dict.fromkeys(REASONS, 0)
        self.beats: list[EngineHeartbeat] = []  # the last view's heartbeats (for metrics)
        self._source: object = None  # the heartbeat list the view was built from
        self.outstanding: dict[tuple[str, str], int] = {}  # (model, engine): routed there, not yet done
        self._changes: deque[tuple[float, str, str, int]] = deque()  # (time.time(), model, engine, +1 / -1)

    def refresh(self, beats: list[EngineHeartbeat], now: float | None = None) -> None:
        """Rebuild candidates from `beats` (a no-op for the list the view was built from) and
        drop hints of engines no longer candidates, confirmed by a heartbeat, or too old."""
        if beats is self._source:
            return
        now = time.time() if now is None else now
        self._source, self.beats = beats, list(beats)
        seen: set[tuple[str, str]] = set()
        for beat in beats:
            view = self.models.setdefault(beat.model, _ModelView())
            seen.add((beat.model, beat.engine_id))
            if not beat.routed or beat.draining or now - beat.time > self.fresh_s or beat.block_size <= 0:
                view.engines.pop(beat.engine_id, None)
                continue
            old = view.engines.get(beat.engine_id)
            if old is not None and old.beat_time == beat.time:
                continue  # the same heartbeat
            own = self._outstanding_at(beat.model, beat.engine_id, beat.time)
            view.engines[beat.engine_id] = _Engine(beat.engine_id, beat.block_size, frozenset(beat.cached),
                                                   engine_load(beat, self.load_slack, own), beat.time,
                                                   frozenset(beat.loras))
        while self._changes and now - self._changes[0][0] > 2 * self.fresh_s:
            self._changes.popleft()  # older than any heartbeat still fresh
        for model, view in list(self.models.items()):
            for engine_id in [e for e in view.engines if (model, e) not in seen]:
                del view.engines[engine_id]  # its heartbeat is gone: dead or stopped
            for key, sent in list(view.hints.items()):
                for engine_id, at in list(sent.items()):
                    engine = view.engines.get(engine_id)
                    if (engine is None or now - at > self.hint_ttl_s
                            or (key in engine.cached and engine.beat_time > at)):
                        del sent[engine_id]
                if not sent:
                    del view.hints[key]
            if not view.engines and not view.hints:
                del self.models[model]

    def choose(self, model: str, token_ids: Sequence[int], lora_name: str = "") -> Route:
        """The stream for a prompt of `model` (see the module docstring), under LoRA adapter
        `lora_name` (only engines announcing that adapter are candidates, and its prefix keys are
        the adapter's); counts the reason and remembers a routed prompt's keys as a hint for its engine."""
        view = self.models.get(model)
        candidates = [] if view is None else [e for e in view.engines.values() if not lora_name or lora_name in e.loras]
        if view is None or not candidates:
            self.counts["shared"] += 1
            return Route(self.keys.requests(model), None, "shared")
        engines = sorted(candidates, key=lambda e: e.engine_id)
        sizes = {e.block_size for e in engines}
        keys_by_size = {size: prefix_keys(token_ids, size, lora_name or None) for size in sizes}
        matches = {e.engine_id: self._match(view, e, keys_by_size[e.block_size]) for e in engines}
        load = {e.engine_id: self._load(e, model) for e in engines}
        best = max(engines, key=lambda e: (matches[e.engine_id], -load[e.engine_id]))
        least = min(engines, key=lambda e: load[e.engine_id])
        if matches[best.engine_id] > 0 and load[best.engine_id] <= load[least.engine_id] + self.load_slack:
            chosen, reason = best, "prefix"
        else:
            chosen, reason = least, "load"
        self._count(model, chosen.engine_id, +1)
        self.counts[reason] += 1
        self._remember(view, chosen.engine_id, keys_by_size[chosen.block_size])
        return Route(self.keys.routed(model, chosen.engine_id), chosen.engine_id, reason,
                     matches[chosen.engine_id])

    def done(self, model: str, engine_id: str) -> None:
        """A request routed to `engine_id` ended at this gateway (finished, failed, cancelled or
        never added): no longer this gateway's load there."""
        self._count(model, engine_id, -1)

    def load(self, model: str, engine_id: str) -> float:
        """The engine's load as routing sees it now (module docstring); 0 for an unknown engine."""
        view = self.models.get(model)
        engine = view.engines.get(engine_id) if view is not None else None
        return self._load(engine, model) if engine is not None else 0.0

    def _load(self, engine: _Engine, model: str) -> float:
        return engine.others + self.outstanding.get((model, engine.engine_id), 0)

    def _count(self, model: str, engine_id: str, change: int) -> None:
        key = (model, engine_id)
        count = self.outstanding.get(key, 0) + change
        if count < 0:
            return  # a `done` without its `choose` (a router replaced meanwhile): nothing to undo
        if count:
            self.outstanding[key] = count
        else:
            self.outstanding.pop(key, None)
        self._changes.append((time.time(), model, engine_id, change))

    def _outstanding_at(self, model: str, engine_id: str, when: float) -> int:
        """This gateway's requests outstanding on the engine at time `when` (recent changes undone)."""
        count = self.outstanding.get((model, engine_id), 0)
        for at, m, e, change in reversed(self._changes):
            if at <= when:
                break
            if m == model and e == engine_id:
                count -= change
        return max(0, count)

    @staticmethod
    def _match(view: _ModelView, engine: _Engine, keys: list[int]) -> int:
        """Leading keys found in the engine's announced set or in this gateway's hints for it."""
        count = 0
        for key in keys:
            if key not in engine.cached and engine.engine_id not in view.hints.get(key, ()):
                break
            count += 1
        return count

    def _remember(self, view: _ModelView, engine_id: str, keys: list[int]) -> None:
        if self.hint_size == 0:
            return
        now = time.time()
        for key in keys:
            view.hints.setdefault(key, {})[engine_id] = now
            view.hints.move_to_end(key)
        while len(view.hints) > self.hint_size:
            view.hints.popitem(last=False)
