"""Byte sizes as people write them: "80GiB", "16G", "512MiB", "1.5GB", "4096".

A bare letter or an ``i`` suffix is binary (``16G`` = ``16GiB`` = 16 x 2**30); a ``B`` after
the letter without ``i`` is decimal (``16GB`` = 16 x 10**9), as in the SI and IEC standards.
"""

from __future__ import annotations

import re
from fractions import Fraction

_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)(?:e(\d+))?\s*([kmgtp]?)(i?)(b?)\s*$", re.IGNORECASE)
_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}


def parse_size(text: str) -> int:
    """Bytes in ``text``; raises ValueError on anything that is not a non-negative size."""
    if str(text).strip().startswith("-"):
        raise ValueError(f"size {text!r} is negative")
    match = _SIZE.match(str(text))
    if match is None:
        raise ValueError(f"invalid size {text!r} (expected e.g. 80GiB, 16G, 512MiB or a byte count)")
    number, exponent, prefix, binary, byte_suffix = match.groups()
    value = Fraction(number) * (10 ** int(exponent) if exponent else 1)
    power = _POWERS[prefix.lower()]
    if binary and not prefix:
        raise ValueError(f"invalid size {text!r}: 'i' needs a prefix such as Ki, Mi, Gi")
    base = 1000 if (byte_suffix and not binary and prefix) else 1024
    return int(value * base**power)


def format_size(num_bytes: float) -> str:
    """Human-readable binary size: ``2.00 MiB``."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
