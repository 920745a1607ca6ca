"""`PoolingParams`: what an embedding request asks of a pooling engine (vLLM's PoolingParams),
built by the gateway, carried in `EngineRequest.pooling`, applied by the engine's pooler.
Torch-free; the pooling itself is `engine.model.pooling`."""

from __future__ import annotations

import sys
from array import array
from dataclasses import dataclass
from typing import Any

POOLING_TYPES = ("LAST", "MEAN", "CLS")  # vLLM's names: last token, mean over the prompt, first token
MAX_DIMENSIONS = 1 << 20


class PoolingParamError(ValueError):
    """A pooling parameter out of range; `param` names the request field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class PoolingParams:
    """`dimensions`: keep the first N values of the pooled vector (Matryoshka models only; None:
    all of them). `normalize`: L2-normalize the vector (after truncation); None: the engine's
    default (vLLM's: yes, unless a sentence-transformers folder lists no Normalize module).
    `pooling_type`: which rows are pooled; empty on the wire (the engine's configured type,
    which the engine fills in at admission)."""

    dimensions: int | None = None
    normalize: bool | None = None
    pooling_type: str = ""

    def validate(self) -> None:
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
                                            or not 1 <= self.dimensions <= MAX_DIMENSIONS):
            raise PoolingParamError(f"dimensions must be an integer in [1, {MAX_DIMENSIONS}], "
                                    f"got {self.dimensions!r}", "dimensions")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise PoolingParamError("normalize must be a boolean", "normalize")
        if self.pooling_type not in ("", *POOLING_TYPES):
            raise PoolingParamError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, "
                                    f"got {self.pooling_type!r}", "pooling_type")

    def to_dict(self) -> dict[str, Any]:
        return {"dimensions": self.dimensions, "normalize": self.normalize, "pooling_type": self.pooling_type}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> PoolingParams:
        """Raises PoolingParamError for a bad value or an unknown key."""
        unknown = sorted(str(k) for k in raw if k not in ("dimensions", "normalize", "pooling_type"))
        if unknown:
            raise PoolingParamError(f"unknown pooling parameter {unknown[0][:40]!r}", unknown[0][:40])
        params = cls(raw.get("dimensions"), raw.get("normalize"), raw.get("pooling_type", ""))
        params.validate()
        return params


def embedding_floats(data: bytes) -> list[float]:
    """A pooled vector's wire bytes (little-endian float32) as floats."""
    values = array("f", data)
    if sys.byteorder == "big":
        values.byteswap()
    return values.tolist()
