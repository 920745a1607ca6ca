"""LoRA adapters over the served model (vLLM's interface): PEFT folders read and checked
(`loader`), each target linear's stacked adapter slots and the batched per-row product (`slots`),
where an adapter's weights go and how they split under tensor parallelism (`placement`), the
adapters kept resident and placed into slots step by step (`manager`), the other ranks' copy of
each placement (`mirror`), and the request's choice of adapter (`request`).

May import torch, safetensors and the modules of `engine.model` it attaches to; never the
scheduler or the worker. The scheduler sees adapters only by name."""

from engine.model.lora.request import LoRAError, LoRARequest

__all__ = ["LoRAError", "LoRARequest"]
