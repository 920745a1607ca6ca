"""The x86 instruction-set level the project uses, and a cap that lowers it on one machine.

Levels, lowest first: ``avx2`` (AVX2 + FMA + F16C), ``avx512`` (F/BW/VL/VNNI: Cascade Lake up),
``avx512_bf16`` (adds the bf16 dot products and VBMI's byte permutes, which the bf16 kernel needs:
Zen 4/5), ``amx`` (adds AMX tiles for bf16). ``PAGEDSERVE_CPU_ISA=<level>``
caps what the project uses below what the CPU has: the C++ kernels are compiled with the higher
extensions switched off (``compiler_flags``; the build key includes them, so each level has its own
library), the Python feature checks behind ``dtype auto`` and the bf16 screens see the CPU's flags
less those above the cap (``flags``), and oneDNN and MKL inside torch are capped to match
(``ONEDNN_MAX_CPU_ISA``, ``MKL_ENABLE_INSTRUCTIONS``, set on import of ``ops`` unless already
set). A cap above the machine's level, or an unknown name, is refused: a cap can only take paths away.
"""

from __future__ import annotations

import os
import platform
from functools import cache
from pathlib import Path

ENV = "PAGEDSERVE_CPU_ISA"
LEVELS = ("avx2", "avx512", "avx512_bf16", "amx")
# /proc/cpuinfo flags each level adds to the one below (all of them must be present).
LEVEL_FLAGS: dict[str, tuple[str, ...]] = {
    "avx2": ("avx2", "fma", "f16c"),
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512_vnni"),
    "avx512_bf16": ("avx512_bf16", "avx512vbmi"),
    "amx": ("amx_tile", "amx_bf16"),
}
# Flags a cap at the level below hides, and the compiler switches that turn their code off. The AMX
# Xeons' AVX512-FP16 and AVX-VNNI go with amx: Zen 4, Zen 5 and Ice Lake lack FP16, Zen 4 and Ice
# Lake AVX-VNNI, and with -march=native on a Xeon gcc emitted both (vmovw, {vex} vpdpbusd) under
# the avx512_bf16 cap, code that not every CPU of that level can run. VBMI goes with avx512_bf16
# (only the bf16 kernel uses it), so a Cascade Lake Xeon, without it, is an avx512 CPU.
HIDDEN_FLAGS: dict[str, tuple[str, ...]] = {
    "avx512": ("avx512", "amx", "avx10", "avx_vnni"),
    "avx512_bf16": ("avx512_bf16", "avx512vbmi", "amx", "avx10"),
    "amx": ("amx", "avx512_fp16", "avx_vnni"),
}
COMPILER_OFF: dict[str, tuple[str, ...]] = {
    "avx512": ("-mno-avx512f", "-mno-avxvnni", "-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"),
    "avx512_bf16": ("-mno-avx512bf16", "-mno-avx512vbmi", "-mno-avx512vbmi2", "-mno-amx-tile", "-mno-amx-bf16",
                    "-mno-amx-int8", "-mno-avx512fp16", "-mno-avxvnni"),
    "amx": ("-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8", "-mno-avx512fp16", "-mno-avxvnni"),
}
# MKL's names (MKL_ENABLE_INSTRUCTIONS; Intel CPUs only, MKL ignores it elsewhere): E1 adds VNNI,
# E3 VNNI and bf16; amx is the top level, left uncapped.
MKL_ISA: dict[str, str | None] = {"avx2": "AVX2", "avx512": "AVX512_E1", "avx512_bf16": "AVX512_E3", "amx": None}
ONEDNN_ISA = {"avx2": "AVX2", "avx512": "AVX512_CORE_VNNI", "avx512_bf16": "AVX512_CORE_BF16",
              "amx": "AVX512_CORE_AMX"}


class IsaCapError(ValueError):
    """PAGEDSERVE_CPU_ISA names no level, or one above this CPU's."""


def parse_flags(cpuinfo: str) -> set[str]:
    """The flags of the first CPU in /proc/cpuinfo text (empty without a flags line)."""
    return set(next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), []))


@cache
def machine_flags() -> frozenset[str]:
    """This CPU's /proc/cpuinfo flags (empty where there is no such file)."""
    try:
        return frozenset(parse_flags(Path("/proc/cpuinfo").read_text()))
    except OSError:
        return frozenset()


def level_of(flags: set[str] | frozenset[str]) -> str | None:
    """The highest level whose flags (and every lower level's) are all in ``flags``; None below AVX2."""
    best = None
    for level in LEVELS:
        if not set(LEVEL_FLAGS[level]) <= flags:
            break
        best = level
    return best


def cap_from_env(value: str | None, flags: set[str] | frozenset[str]) -> str | None:
    """The cap ``value`` names (None: no cap), checked against a CPU with ``flags``."""
    if not value:
        return None
    if value not in LEVELS:
        raise IsaCapError(f"{ENV}={value!r} is not a level; choose one of {', '.join(LEVELS)}")
    have = level_of(flags)
    if have is None or LEVELS.index(value) > LEVELS.index(have):
        raise IsaCapError(f"{ENV}={value} is above this CPU's level ({have or 'below avx2'}): a cap only lowers it")
    return value


def cap() -> str | None:
    """The level PAGEDSERVE_CPU_ISA caps this process at (None: the machine's own)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    return cap_from_env(os.environ.get(ENV), machine_flags())


def _above(level: str) -> list[str]:
    return list(LEVELS[LEVELS.index(level) + 1:])


def capped_flags(flags: set[str] | frozenset[str], level: str | None) -> set[str]:
    """``flags`` less those of the levels above ``level`` (all of them for None: no cap)."""
    if level is None:
        return set(flags)
    hidden = [prefix for up in _above(level) for prefix in HIDDEN_FLAGS[up]]
    return {f for f in flags if not any(f.startswith(prefix) for prefix in hidden)}


def flags() -> set[str]:
    """This CPU's flags as the project may use them (under the cap)."""
    return capped_flags(machine_flags(), cap())


def level() -> str | None:
    """The level the project runs at: the cap, else the machine's."""
    return level_of(flags())


def compiler_flags() -> list[str]:
    """Switches after -march=native that keep the kernels' code at or below the cap."""
    level = cap()
    above = _above(level) if level is not None else []
    return list(COMPILER_OFF[above[0]]) if above else []


def machine_levels() -> list[str]:
    """Every level this CPU can run, lowest first (what the tests run the kernels at)."""
    have = level_of(machine_flags())
    return [] if have is None else list(LEVELS[:LEVELS.index(have) + 1])


def apply_onednn_cap() -> None:
    """Cap oneDNN and MKL (inside torch) at the same level, unless ONEDNN_MAX_CPU_ISA /
    MKL_ENABLE_INSTRUCTIONS are set already; effective only before their first use in the process.
    torch's fp32 GEMMs (`F.linear`) run on MKL, which ignores oneDNN's variable: capped to avx2
    through it alone they still run AVX-512."""
    level = cap()
    if level is not None:
        os.environ.setdefault("ONEDNN_MAX_CPU_ISA", ONEDNN_ISA[level])
        if MKL_ISA[level] is not None:
            os.environ.setdefault("MKL_ENABLE_INSTRUCTIONS", str(MKL_ISA[level]))
