"""The `--rate-limits FILE`: per-API-key request and token limits (JSON or TOML), and its reload.

Format (docs/configuration.md, "Rate limits")::

    {"window_seconds": 60,
     "default": {"requests_per_minute": 60, "tokens_per_minute": 40000},
     "keys": {"sk-team-a": {"requests_per_minute": 600},
              "sha256:<hex of the key>": {"tokens_per_minute": null}}}

A key override takes each field it gives (null: unlimited) and the default's for the rest. Keys
are held as SHA-256 hex digests only (`key_hash`); the file may name a key by its digest."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib
import json
import os
import signal
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.log import get_logger

log = get_logger("gateway")
_FIELDS = ("requests_per_minute", "tokens_per_minute")
_UNSET = object()


class RateLimitConfigError(ValueError):
    """The file is unreadable or not in the format above."""


def key_hash(api_key: str) -> str:
    """SHA-256 hex digest of an API key: the only form of a key kept in memory or Redis."""
    return hashlib.sha256(api_key.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class Limit:
    """Requests and tokens per window for one key; None = unlimited."""

    requests: int | None = None
    tokens: int | None = None

    @property
    def unlimited(self) -> bool:
        return self.requests is None and self.tokens is None


@dataclass(frozen=True, slots=True)
class RateLimits:
    """Limits per window (`window_s`, 60 s unless the file says otherwise): `default` for any key
    (also for requests without one), `keys` by `key_hash`."""

    default: Limit = Limit()
    keys: Mapping[str, Limit] = field(default_factory=dict)
    window_s: float = 60.0

    def for_key(self, api_key: str | None) -> tuple[str, Limit]:
        """(bucket id, limit) of a request's key: its hash, or "anonymous" without a key."""
        if api_key is None:
            return "anonymous", self.default
        digest = key_hash(api_key)
        return digest, self.keys.get(digest, self.default)


def _count(section: str, name: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise RateLimitConfigError(f"{section}.{name} must be a positive integer or null, not {value!r}")
    return value


def _limit(section: str, raw: Any, base: Limit) -> Limit:
    if not isinstance(raw, dict):
        raise RateLimitConfigError(f"{section} must be a table/object")
    unknown = set(raw) - set(_FIELDS)
    if unknown:
        raise RateLimitConfigError(f"{section}: unknown field(s) {sorted(unknown)}; expected {list(_FIELDS)}")
    requests = raw.get("requests_per_minute", _UNSET)
    tokens = raw.get("tokens_per_minute", _UNSET)
    return Limit(base.requests if requests is _UNSET else _count(section, "requests_per_minute", requests),
                 base.tokens if tokens is _UNSET else _count(section, "tokens_per_minute", tokens))


def parse_limits(data: Any) -> RateLimits:
    """RateLimits from a decoded file; RateLimitConfigError when it is not in the format."""
    if not isinstance(data, dict):
        raise RateLimitConfigError("the file must hold a table/object")
    unknown = set(data) - {"default", "keys", "window_seconds"}
    if unknown:
        raise RateLimitConfigError(f"unknown top-level field(s) {sorted(unknown)}")
    window = data.get("window_seconds", 60)
    if isinstance(window, bool) or not isinstance(window, int | float) or not 0.001 <= window <= 86400:
        raise RateLimitConfigError(f"window_seconds must be a number in [0.001, 86400], not {window!r}")
    default = _limit("default", data.get("default", {}), Limit())
    raw_keys = data.get("keys", {})
    if not isinstance(raw_keys, dict):
        raise RateLimitConfigError("keys must be a table/object of API key -> limits")
    keys: dict[str, Limit] = {}
    for name, raw in raw_keys.items():
        if not name:
            raise RateLimitConfigError("keys: an empty API key")
        digest = name[7:].lower() if name.startswith("sha256:") else key_hash(name)
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise RateLimitConfigError("keys: 'sha256:' must be followed by 64 hex digits")
        # the section name shows a digest, never the key itself (logs and errors may be shared)
        keys[digest] = _limit(f"keys[sha256:{digest[:12]}...]", raw, default)
    return RateLimits(default, keys, float(window))


def _toml(text: str) -> Any:
    """Decode TOML: tomllib (Python 3.11+), else tomli when installed."""
    for name in ("tomllib", "tomli"):
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError:
            continue
        try:
            return module.loads(text)
        except module.TOMLDecodeError as exc:
            raise RateLimitConfigError(f"invalid TOML: {exc}") from exc
    raise RateLimitConfigError("TOML needs Python 3.11+ (or the tomli package); use JSON")


def load_limits(path: str | Path) -> RateLimits:
    """Read and parse `path`: TOML when it ends in .toml, else JSON."""
    path = Path(path)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise RateLimitConfigError(f"cannot read {path}: {exc}") from exc
    if path.suffix.lower() == ".toml":
        try:
            data = _toml(text)
        except RateLimitConfigError as exc:
            raise RateLimitConfigError(f"{path}: {exc}") from exc
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise RateLimitConfigError(f"{path}: invalid JSON: {exc}") from exc
    return parse_limits(data)


class LimitsFile:
    """The current limits of one file. `reload` re-reads it when its mtime (or size) changed or
    when forced; a bad file then keeps the old limits and logs why. Construction raises
    RateLimitConfigError on a bad file (the gateway refuses to start)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.limits = load_limits(self.path)
        self._stamp = self._stat()
        self.reloads = 0  # new limits taken
        self.rejected = 0  # bad files seen (and kept out)

    def _stat(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size

    def reload(self, force: bool = False) -> bool:
        """Re-read the file if it changed (or `force`); True when new limits were taken."""
        stamp = self._stat()
        if not force and stamp == self._stamp:
            return False
        self._stamp = stamp
        try:
            limits = load_limits(self.path)
        except RateLimitConfigError as exc:
            self.rejected += 1
            log.error("rate limits not reloaded; keeping the previous ones", path=str(self.path), error=str(exc))
            return False
        self.limits = limits
        self.reloads += 1
        log.info("rate limits reloaded", path=str(self.path), keys=len(limits.keys))
        return True

    async def watch(self, interval_s: float = 2.0) -> None:
        """Poll the mtime every `interval_s` and reload on SIGHUP, until cancelled."""
        loop = asyncio.get_running_loop()
        hup = False
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):  # not the main thread
            loop.add_signal_handler(signal.SIGHUP, self.reload, True)
            hup = True
        try:
            while True:
                await asyncio.sleep(interval_s)
                self.reload()
        finally:
            if hup:
                loop.remove_signal_handler(signal.SIGHUP)
