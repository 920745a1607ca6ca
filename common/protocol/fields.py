"""Decoding wire bytes without trusting them: msgpack framing, the version check, and one
checked getter per field type. Each raises only `ProtocolError`, whatever the bytes hold
(unhashable map keys, wrong types, booleans posing as numbers, NaN, huge integers, huge lists),
so a reader can dead-letter the entry and go on."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import msgpack

PROTOCOL_VERSION = 2
MAX_LIST = 1 << 20  # token ids / outputs in one message: far beyond any model's context
MAX_TEXT = 1 << 16  # ids, names, messages
INT32_MAX = 2**31 - 1
_MISSING: Any = object()


class ProtocolError(ValueError):
    """A wire message that cannot be decoded (wrong version, missing or mistyped field)."""


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: Any) -> Any:
    """msgpack bytes → plain objects; ProtocolError for anything else (never TypeError)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"expected bytes, got {type(data).__name__}")
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as exc:
        raise ProtocolError(f"not a msgpack message: {exc!r}") from exc


@contextlib.contextmanager
def decoding(what: str) -> Iterator[None]:
    """Turn any error raised while building a message from checked fields into ProtocolError."""
    try:
        yield
    except ProtocolError:
        raise
    except Exception as exc:
        raise ProtocolError(f"{what}: bad field: {exc!r}") from exc


def message_map(obj: Any, what: str) -> dict[str, Any]:
    """A map of this protocol version (a missing `v` counts as this version)."""
    if not isinstance(obj, dict):
        raise ProtocolError(f"{what}: expected a map, got {type(obj).__name__}")
    if obj.get("v", PROTOCOL_VERSION) != PROTOCOL_VERSION:
        raise ProtocolError(f"{what}: protocol version {obj.get('v')!r}, expected {PROTOCOL_VERSION}")
    return obj


def _get(obj: dict[str, Any], key: str, what: str, default: Any) -> Any:
    if key in obj:
        return obj[key]
    if default is _MISSING:
        raise ProtocolError(f"{what}: missing field {key!r}")
    return default


def text(obj: dict[str, Any], key: str, what: str, default: Any = _MISSING) -> str:
    value = _get(obj, key, what, default)
    if not isinstance(value, str) or len(value) > MAX_TEXT:
        raise ProtocolError(f"{what}: {key} must be a string of at most {MAX_TEXT} characters")
    return value


def optional_text(obj: dict[str, Any], key: str, what: str) -> str | None:
    return None if obj.get(key) is None else text(obj, key, what)


def integer(obj: dict[str, Any], key: str, what: str, lo: int = 0, hi: int = 2**63 - 1,
            default: Any = _MISSING) -> int:
    value = _get(obj, key, what, default)
    if not is_int(value) or not lo <= value <= hi:
        raise ProtocolError(f"{what}: {key} must be an integer in [{lo}, {hi}], got {_short(value)}")
    return int(value)


def number(obj: dict[str, Any], key: str, what: str, default: Any = _MISSING) -> float:
    value = _get(obj, key, what, default)
    if not is_number(value):
        raise ProtocolError(f"{what}: {key} must be a finite number, got {_short(value)}")
    return float(value)


def optional_number(obj: dict[str, Any], key: str, what: str) -> float | None:
    return None if obj.get(key) is None else number(obj, key, what)


def int_list(obj: dict[str, Any], key: str, what: str, lo: int = 0, hi: int = INT32_MAX,
             default: Any = _MISSING) -> list[int]:
    values = items(obj, key, what, default)
    if not all(is_int(v) and lo <= v <= hi for v in values):
        raise ProtocolError(f"{what}: {key} must hold integers in [{lo}, {hi}]")
    return [int(v) for v in values]


def items(obj: dict[str, Any], key: str, what: str, default: Any = _MISSING) -> list[Any]:
    value = _get(obj, key, what, default)
    if not isinstance(value, (list, tuple)) or len(value) > MAX_LIST:
        raise ProtocolError(f"{what}: {key} must be a list of at most {MAX_LIST} items")
    return list(value)


def mapping(obj: dict[str, Any], key: str, what: str, default: Any = _MISSING) -> dict[str, Any]:
    value = _get(obj, key, what, default)
    if not isinstance(value, dict):
        raise ProtocolError(f"{what}: {key} must be a map")
    return value


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A finite float, or an int a float can hold (math.isfinite overflows on huge ints)."""
    if is_int(value):
        return bool(value.bit_length() <= 1000)
    return isinstance(value, float) and math.isfinite(value)


def _short(value: Any) -> str:
    shown = repr(value) if not isinstance(value, int) or value.bit_length() < 256 else "a huge integer"
    return shown[:60]
