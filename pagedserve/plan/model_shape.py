"""The KV-cache shape of a model, from flags or from a Hugging Face config.json (no torch, no
transformers: plain JSON, so `pagedserve plan` starts instantly)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from engine.model.spec import KV_SCALE_BYTES, kv_bytes_per_token, kv_geometry, lora_slot_elements

DTYPE_BYTES: dict[str, int] = {
    "fp32": 4, "float32": 4, "float": 4,
    "fp16": 2, "float16": 2, "half": 2, "bf16": 2, "bfloat16": 2,
    "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1,
}
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt")


class PlanError(ValueError):
    """Input that makes no sense for capacity planning; the CLI prints it and exits 2."""


def scale_bytes(name: str) -> int:
    """Per-row scale bytes of a KV dtype name: 2 for pagedserve's int8 rows (their fp16 scale), else 0."""
    return KV_SCALE_BYTES.get(str(name).lower().removeprefix("torch."), 0)


def dtype_bytes(name: str) -> int:
    """Bytes per element of a dtype name ("fp16", "torch.bfloat16", ...)."""
    key = str(name).lower().removeprefix("torch.")
    if key not in DTYPE_BYTES:
        raise PlanError(f"unknown dtype {name!r} (known: fp32, fp16, bf16, fp8, int8)")
    return DTYPE_BYTES[key]


@dataclass(frozen=True, slots=True)
class KVShape:
    """What one token's K and V cost: 2 x layers x kv_heads x (head_dim x dtype bytes + scale bytes)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int
    scale_bytes: int = 0

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "dtype_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise PlanError(f"{name} must be a positive integer, got {value!r}")
        if self.scale_bytes < 0:
            raise PlanError(f"scale_bytes must not be negative, got {self.scale_bytes}")

    @property
    def bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype_bytes,
                                  self.scale_bytes)

    @classmethod
    def from_parts(cls, layers: Any, kv_heads: Any, head_dim: Any, dtype: str) -> KVShape:
        """Build from flag values; a missing one is a PlanError naming the flag."""
        for flag, value in (("--layers", layers), ("--kv-heads", kv_heads), ("--head-dim", head_dim)):
            if value is None:
                raise PlanError(f"{flag} is required (or give --model PATH)")
            if value <= 0:
                raise PlanError(f"{flag} must be a positive integer, got {value}")
        return cls(int(layers), int(kv_heads), int(head_dim), dtype_bytes(dtype), scale_bytes(dtype))


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What a model directory tells the planner."""

    shape: KVShape
    dtype: str
    weights: int
    max_model_len: int | None
    config: dict[str, Any] | None = None


def read_model_dir(path: Path) -> ModelInfo:
    """Read config.json (in ``path`` or ``path`` itself) and sum the weight files beside it."""
    config_path = path / "config.json" if path.is_dir() else path
    try:
        config: dict[str, Any] = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise PlanError(f"cannot read model config {config_path}: {exc}") from None
    config = config.get("text_config", config) if "num_hidden_layers" not in config else config
    try:
        shape_parts = kv_geometry(SimpleNamespace(**config))
    except (AttributeError, TypeError, ValueError) as exc:
        raise PlanError(f"{config_path} lacks a usable field: {exc}") from None
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "fp16")
    shape = KVShape(*shape_parts, dtype_bytes(dtype))
    weights = sum(f.stat().st_size for f in config_path.parent.iterdir() if f.name.endswith(WEIGHT_SUFFIXES))
    max_len = config.get("max_position_embeddings")
    return ModelInfo(shape, dtype, weights, int(max_len) if max_len else None, config=config)


def lora_slot_bytes(model: ModelInfo, max_loras: int, max_lora_rank: int, tensor_parallel_size: int = 1) -> int:
    """Bytes the engine's `max_loras` adapter slots at `max_lora_rank` take over this model (on each
    rank of `tensor_parallel_size`: its part of every slot)."""
    try:
        elements = lora_slot_elements(SimpleNamespace(**(model.config or {})), max_lora_rank, tensor_parallel_size)
    except (AttributeError, TypeError, ValueError) as exc:
        raise PlanError(f"the model config lacks a field LoRA slots are sized by: {exc}") from None
    return max_loras * elements * model.shape.dtype_bytes
