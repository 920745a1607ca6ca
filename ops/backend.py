"""Which implementation the public ops dispatch to: compiled kernels or the torch reference."""

from __future__ import annotations

from typing import Literal

Backend = Literal["auto", "reference"]
_BACKENDS: tuple[str, ...] = ("auto", "reference")
_state: dict[str, str] = {"backend": "auto", "fixed_order": ""}


def set_backend(name: str) -> None:
    """Select ``"auto"`` (compiled CPU/CUDA kernels) or ``"reference"`` (plain torch)."""
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {list(_BACKENDS)}")
    _state["backend"] = name


def get_backend() -> str:
    """The backend currently selected (``"auto"`` by default)."""
    return _state["backend"]


def use_reference() -> bool:
    """True when the plain-torch reference was asked for."""
    return _state["backend"] == "reference"


def set_fixed_order(on: bool) -> None:
    """Batch-invariant arithmetic for the ops that have a choice (``ops.linear``: every fp32 CPU row
    through ``fixed_gemm``, one reduction order whatever the step's row count), or the fastest
    kernel for each row count (the default). The engine sets it from its ``deterministic`` option."""
    _state["fixed_order"] = "1" if on else ""


def fixed_order() -> bool:
    """Whether ``set_fixed_order(True)`` is in force."""
    return bool(_state["fixed_order"])
