"""How the ops compute: an immutable ``OpsPolicy`` that every op takes as an argument (``policy=``),
never a process-wide switch. An engine builds one from its config (``attention_backend``,
``deterministic``, device) and hands it to its model and sampler when it builds them, so two
engines in one process each keep their own arithmetic."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Backend = Literal["auto", "reference"]
BACKENDS: tuple[str, ...] = ("auto", "reference")


@dataclass(frozen=True, slots=True)
class OpsPolicy:
    """``reference``: every op runs the plain-torch oracle (:mod:`ops.reference`) instead of the
    compiled kernels (C++ for CPU tensors, CUDA for CUDA tensors). ``fixed_order``: batch-invariant
    arithmetic for the ops that have a choice (``ops.linear``: every fp32 CPU row through
    ``fixed_gemm``; ``ops.quant``: a row on the kernel at every count; prefill attention through
    decode's per-row path), one reduction order whatever the step's row count; off, the fastest
    kernel for each row count. The ISA level is not a field: it is fixed per process by the
    compiled library (``ops.isa``, ``PAGEDSERVE_CPU_ISA``)."""

    reference: bool = False
    fixed_order: bool = False

    @classmethod
    def of(cls, backend: str = "auto", fixed_order: bool = False) -> OpsPolicy:
        """The policy of an ``attention_backend`` name (``"auto"`` or ``"reference"``); ValueError otherwise."""
        if backend not in BACKENDS:
            raise ValueError(f"unknown attention backend {backend!r}; choose one of {list(BACKENDS)}")
        return cls(reference=backend == "reference", fixed_order=fixed_order)

    @property
    def backend(self) -> Backend:
        """The backend's name, as ``attention_backend`` spells it."""
        return "reference" if self.reference else "auto"


FASTEST = OpsPolicy()  # compiled kernels, the fastest one for each row count: what an op uses unless told
REFERENCE = OpsPolicy(reference=True)  # the plain-torch oracle
FIXED_ORDER = OpsPolicy(fixed_order=True)  # compiled kernels, one arithmetic per row at any row count
