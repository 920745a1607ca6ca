"""Speculative decoding without a draft model: n-gram (prompt lookup) proposals, verified exactly."""

from engine.spec.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
