"""JIT build of the kernels with torch.utils.cpp_extension + ninja into a per-user cache.

The build directory is keyed by the sources' hash, the torch version, the device kind and
the compiler flags, so a changed source or another torch never reuses a stale library.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import platform
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import structlog
import torch

from ops import isa

CSRC = Path(__file__).resolve().parent.parent / "csrc"
# Sources, then headers: everything whose change must trigger a rebuild.
CPU_SOURCES = (
    "cpu/attention.cpp", "cpu/prefill_attention.cpp", "cpu/cache.cpp", "cpu/fused.cpp", "cpu/gemv.cpp",
    "cpu/sampling.cpp", "cpu/screen.cpp", "cpu/fixed_gemm.cpp", "cpu/quant_gemm.cpp", "cpu/quant_interleaved.cpp",
    "cpu/quant_interleaved_q5q8.cpp", "cpu/quant_interleaved_k.cpp",
    "cpu/quant_bf16.cpp", "cpu/quant_bf16_dot.cpp", "cpu/quant_amx.cpp", "cpu/quant_int8_amx.cpp",
    "cpu/quant_screen.cpp", "cpu/decoder.cpp", "cpu/packed_moe.cpp", "cpu/lora.cpp", "cpu/registration.cpp",
)
CPU_HEADERS = ("cpu/ops.h", "cpu/parallel.h", "cpu/vec.h", "cpu/kv_quant.h", "cpu/quant_blocks.h",
               "cpu/quant_interleaved.h", "cpu/quant_interleaved_q5q8.h", "cpu/quant_interleaved_k.h", "cpu/r8_lanes.h",
               "cpu/row_passes.h", "cpu/quant_bf16.h", "cpu/quant_int8_amx.h", "cpu/amx_tiles.h", "cpu/lora.h")
CUDA_SOURCES = (
    "bindings.cpp", "paged_attention.cu", "prefill_attention.cu", "cache_kernels.cu", "fused_kernels.cu",
)
CUDA_HEADERS = ("ops.h", "dtype_utils.cuh", "kv_quant.cuh")

log = structlog.get_logger(component="ops.build")


class KernelBuildError(RuntimeError):
    """Compiling the kernels failed; the message carries the compiler output."""


def cache_root() -> Path:
    """``$PAGEDSERVE_CACHE/kernels`` if set, else ``~/.cache/pagedserve/kernels``."""
    base = os.environ.get("PAGEDSERVE_CACHE")
    root = Path(base) if base else Path.home() / ".cache" / "pagedserve"
    return root / "kernels"


# Floating-point contraction the same on every CPU: the kernels' `acc += a * b` chains are FMAs by
# design (a row's bits must not depend on the CPU's tuning or on the rows beside it). GCC's AMD
# tunings (-march=native on a Zen picks znver*) set avoid-fma-max-bits, under which a loop's lone
# accumulator chain becomes a multiply and an add (two roundings) while a chain beside others stays
# fused, so one row alone and the same row in a tile of six rounded differently.
CONTRACTION_FLAGS = ("-ffp-contract=fast", "--param=avoid-fma-max-bits=0")


def cpu_cflags() -> list[str]:
    """-O3 and OpenMP (at::parallel_for is inlined OpenMP); -march=native on x86-64 unless disabled.

    -march=native is safe because the cache key includes this CPU's feature flags, so a library
    is never loaded on a machine whose CPU it was not built for. PAGEDSERVE_NATIVE=0 turns it off.
    """
    flags = ["-O3", "-fopenmp"]  # the C++ standard is torch's choice (C++20 for torch 2.13)
    flags += [flag for flag in CONTRACTION_FLAGS if _compiler_accepts(flag)]
    if platform.machine() in ("x86_64", "AMD64") and os.environ.get("PAGEDSERVE_NATIVE", "1") != "0":
        flags.append("-march=native")
        # PAGEDSERVE_CPU_ISA: the extensions above the cap switched off (those this compiler knows:
        # one it does not know is one -march=native cannot have switched on)
        flags += [flag for flag in isa.compiler_flags() if _compiler_accepts(flag)]
    return flags


@functools.cache
def _compiler_accepts(flag: str) -> bool:
    """Whether the C++ compiler torch's extension builder runs (``$CXX``, else ``c++``) takes `flag`."""
    compiler = os.environ.get("CXX", "c++")
    try:
        done = subprocess.run([compiler, flag, "-x", "c++", "-fsyntax-only", "-"], input="", capture_output=True,
                              text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return True  # let the build say what is wrong with the compiler
    return done.returncode == 0


def cuda_cflags() -> list[str]:
    """nvcc flags for the CUDA kernels (the arch list comes from torch / TORCH_CUDA_ARCH_LIST)."""
    return ["-O3", "-lineinfo"]


def _cpu_fingerprint() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    flags = next((line for line in text.splitlines() if line.startswith(("flags", "Features"))), "")
    return platform.machine() + flags


def build_key(kind: str, files: tuple[str, ...], flags: list[str]) -> str:
    """Hash of sources and headers, torch version, device kind, flags and the machine it targets."""
    digest = hashlib.sha256()
    for rel in files:
        path = CSRC / rel
        digest.update(rel.encode())
        digest.update(path.read_bytes() if path.exists() else b"")
    target = _cpu_fingerprint() if kind == "cpu" else f"cuda{torch.version.cuda}"
    # the checkout too: ninja rebuilds whenever the sources' paths in its commands change, so two
    # checkouts sharing one build directory would rebuild each other's library on every switch
    for part in (kind, torch.__version__, " ".join(flags), target, str(CSRC)):
        digest.update(part.encode())
    return digest.hexdigest()[:16]


@contextlib.contextmanager
def _builder_lock(build_dir: Path) -> Iterator[None]:
    """One builder (or loader) of `build_dir` at a time, on an `flock` the kernel releases when its
    holder dies. torch's own baton (a `lock` file it creates and deletes) waits forever for a builder
    that was killed (kill -9, a test timeout, an interrupted benchmark); under this lock any `lock`
    file left there is such a dead builder's, and goes."""
    with (build_dir / "builder.flock").open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            stale = build_dir / "lock"
            if stale.exists():
                log.warning("removing a dead builder's kernel build lock", lock=str(stale))
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _load(kind: str, sources: tuple[str, ...], headers: tuple[str, ...] = (), **flags: Any) -> str:
    name = f"pagedserve_{kind}"
    key = build_key(kind, (*sources, *headers), [*flags.get("extra_cflags", []), *flags.get("extra_cuda_cflags", [])])
    build_dir = cache_root() / f"{kind}-{key}"
    build_dir.mkdir(parents=True, exist_ok=True)
    with _builder_lock(build_dir):
        return _load_locked(kind, name, build_dir, sources, **flags)


def _load_locked(kind: str, name: str, build_dir: Path, sources: tuple[str, ...], **flags: Any) -> str:
    fresh = not (build_dir / f"{name}.so").exists()
    if fresh:
        log.info("building kernels (first use: ~10 s CPU, minutes CUDA)", kind=kind, dir=str(build_dir),
                 isa=isa.level() if kind == "cpu" else None)
    started = time.perf_counter()
    from torch.utils.cpp_extension import load

    try:
        path = load(
            name=name,
            sources=[str(CSRC / s) for s in sources],
            extra_include_paths=[str(CSRC)],
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=False,
            **flags,
        )
    except Exception as exc:  # cpp_extension raises RuntimeError/CalledProcessError with the output
        output = getattr(exc, "output", None)
        detail = output.decode(errors="replace") if isinstance(output, bytes) else str(output or "")
        raise KernelBuildError(
            f"building the {kind} kernels in {build_dir} failed: {exc}\n{detail}\n"
            "Fix the toolchain (a C++17 compiler, ninja; nvcc matching torch.version.cuda for CUDA) "
            "or run with --attention-backend reference."
        ) from exc
    if fresh:
        log.info("kernels built", kind=kind, seconds=round(time.perf_counter() - started, 1))
    return str(path)


def prepare(device: torch.device) -> None:
    """Build (or load) the kernels of `device` now, so the first request does not wait for a
    compiler (a first CPU build takes a minute or more on two cores)."""
    if device.type == "cuda":
        cuda_ops()
    else:
        cpu_ops()


@functools.cache
def cpu_library() -> str:
    """Path of the compiled CPU ops library for this machine and ISA cap, built on first call."""
    return _load("cpu", CPU_SOURCES, CPU_HEADERS, extra_cflags=cpu_cflags(), extra_ldflags=["-fopenmp"])


@functools.cache
def cpu_ops() -> Any:
    """The compiled CPU ops (``torch.ops.pagedserve_cpu``), built on first call."""
    cpu_library()
    return torch.ops.pagedserve_cpu


@functools.cache
def cuda_ops() -> Any:
    """The compiled CUDA ops (``torch.ops.pagedserve_cuda``); needs a CUDA build of torch."""
    if torch.version.cuda is None:
        raise KernelBuildError(
            "this torch has no CUDA support (CPU wheel): install a CUDA torch to run on GPU tensors"
        )
    _load("cuda", CUDA_SOURCES, CUDA_HEADERS, extra_cflags=["-O3"], extra_cuda_cflags=cuda_cflags())
    return torch.ops.pagedserve_cuda
