"""Speculative decoding without a draft model: n-gram (prompt lookup) and suffix proposals; they are
verified exactly where every token is chosen (`engine.sample.verify`)."""

from engine.spec.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
