"""Which threads the CPU kernels share for a step (csrc/cpu/parallel.h): from `openmp_rows` rows on,
a step's linear layers run on oneDNN, that is on OpenMP's threads, and the other kernels join
them; below it every kernel uses pagedserve's chunk pool, which never waits at a barrier for a
thread the OS has not scheduled (on a machine shared with other work, that wait is a time slice
per parallel region). Where oneDNN starts depends on the weights: `small_gemm` up to
SMALL_GEMM_MAX_ROWS rows of fp32, `quant_linear`'s own kernel up to QUANT_GEMV_MAX_ROWS."""

from __future__ import annotations

from ops.build import cpu_ops
from ops.linear import SMALL_GEMM_MAX_ROWS
from ops.quant import QUANT_GEMV_MAX_ROWS

NEVER = 1 << 40  # no step runs its linears on oneDNN (fixed order)


def openmp_rows_for(quantized_weights: bool, fixed_order: bool = False) -> int:
    """The first row count whose linear layers run on oneDNN for these weights."""
    if fixed_order:  # fp32 linears on fixed_gemm, packed ones on their kernel at every row count
        return NEVER
    return (QUANT_GEMV_MAX_ROWS if quantized_weights else SMALL_GEMM_MAX_ROWS) + 1


def set_openmp_rows(rows: int) -> None:
    """Process-wide (one engine's model per process; engines in one process serve alike)."""
    cpu_ops().set_openmp_rows(rows)


def openmp_rows() -> int:
    return int(cpu_ops().openmp_rows())
