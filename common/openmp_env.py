"""How long OpenMP's idle threads spin: bounded before torch loads its OpenMP runtime.

After every parallel region libgomp's worker threads spin `GOMP_SPINCOUNT` rounds before they
sleep (300,000 by default: milliseconds of `pause`). pagedserve's CPU kernels share the
cores between OpenMP (oneDNN GEMMs, ATen ops inside the fused decoder, the bf16 lm_head screen)
and their own chunk pool (csrc/cpu/parallel.h), so a worker still spinning after a GEMM holds a
core the pool's helper needs (docs/performance.md). libgomp reads the variable once, when it is
loaded (by `import torch`), so `bound_openmp_spin` runs first thing in `engine` and `benchmarks`,
neither of which imports torch before it (`ops`, the kernels' package, imports nothing of the
project's: it is reached through `engine`). A choice of the user's (`GOMP_SPINCOUNT` or
`OMP_WAIT_POLICY` in the environment) is kept. A peer's process in the benchmarks gets the
environment without the bound (`peer_environ`): llama.cpp's ggml runs on libgomp too. Torch-free
(common/ never imports torch).
"""

from __future__ import annotations

import os
import sys

_set_here = False  # whether bound_openmp_spin set the variable (not the user)
SPIN_COUNT = 10_000  # rounds: under a millisecond, enough for back-to-back GEMMs to find their threads awake
USER_CHOICES = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")


def bound_openmp_spin() -> bool:
    """Set `GOMP_SPINCOUNT` for the OpenMP runtime torch is about to load, unless the user chose a
    spin or wait policy. True when the spin is bounded (by this call, an earlier one, or the user)."""
    if any(name in os.environ for name in USER_CHOICES):
        return True
    if "torch" in sys.modules:  # libgomp already read its environment: too late
        return False
    global _set_here
    os.environ["GOMP_SPINCOUNT"] = str(SPIN_COUNT)
    _set_here = True
    return True


def peer_environ() -> dict[str, str]:
    """This process's environment as a peer system's process should get it (vLLM, llama.cpp in the
    benchmarks): without the spin bound set here, so each peer runs its OpenMP as its users would."""
    env = dict(os.environ)
    if _set_here and env.get("GOMP_SPINCOUNT") == str(SPIN_COUNT):
        del env["GOMP_SPINCOUNT"]
    return env


def openmp_spin_note() -> str | None:
    """A warning for the startup log when OpenMP kept its default spin (torch imported first)."""
    if any(name in os.environ for name in USER_CHOICES):
        return None
    return (f"torch was imported before pagedserve: OpenMP threads spin ~300,000 rounds after each "
            f"parallel region and take cores from the kernels' own threads; set GOMP_SPINCOUNT={SPIN_COUNT} "
            f"(or import engine first)")
