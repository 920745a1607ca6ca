"""Which implementation the public ops dispatch to: compiled kernels or the torch reference."""

from __future__ import annotations

from typing import Literal

Backend = Literal["auto", "reference"]
_BACKENDS: tuple[str, ...] = ("auto", "reference")
_state: dict[str, str] = {"backend": "auto"}


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
