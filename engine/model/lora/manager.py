"""The adapters an engine serves: registered by name (`--lora-modules`, or a request's
`LoRARequest`), up to `max_cpu_loras` kept read in host memory (least recently used dropped,
read again from their folder when asked), up to `max_loras` placed in the model's slots for a
step (`LoRASlots` attached to each target linear as its `lora`). The scheduler never puts more
than `max_loras` distinct adapters in one step, so a step's adapters always find slots. Under
tensor parallelism each rank's slots hold its part of each adapter (`placement`, `mirror`)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from common.log import get_logger
from engine.model.lora.loader import LoRAAdapter, load_adapter
from engine.model.lora.placement import TARGETS, Weights, attach_slots, full_shape, place_weights, shard_weights
from engine.model.lora.request import LoRAError

log = get_logger("lora")

LoRAMirror = Callable[[int, Weights], None]  # rank 0 of a tensor-parallel group: place in a slot on the others


class LoRAManager:
    """Adapters by name for one model (`engine.model.llama.LlamaForCausalLM`). Under tensor
    parallelism this is rank 0's: it reads and checks every adapter, keeps its own part in its
    slots and hands each placement to `mirror` (`TensorParallelGroup.place_lora`), which gives
    every other rank its part of the same slot (`engine.model.lora.placement`)."""

    def __init__(self, model: Any, max_loras: int, max_cpu_loras: int, max_rank: int,
                 mirror: LoRAMirror | None = None) -> None:
        if model.spec.rotary_dim is not None:
            raise LoRAError(f"{model.spec.model_type}: LoRA is not supported with partial rotary embeddings",
                            "lora_unsupported")
        if max_loras < 1 or max_cpu_loras < max_loras or max_rank < 1:
            raise ValueError("max_loras and max_lora_rank must be >= 1 and max_cpu_loras >= max_loras")
        self.max_loras, self.max_cpu_loras, self.max_rank = max_loras, max_cpu_loras, max_rank
        self.num_layers = len(model.model.layers)
        self.shard, self.spec = model.shard, model.spec
        self.mirror = mirror
        self.linears = attach_slots(model, max_loras, max_rank)
        self.paths: dict[str, str] = {}
        self.resident: OrderedDict[str, LoRAAdapter] = OrderedDict()  # host copies, least recent first
        self.placed: list[str | None] = [None] * max_loras
        self.last_used: list[int] = [0] * max_loras
        self._clock = 0

    @property
    def slot_bytes(self) -> int:
        """Bytes one adapter slot takes in the model (every target linear at `max_lora_rank`; under
        tensor parallelism this rank's part, which every rank holds alike)."""
        return sum(s.nbytes_per_slot for s in self.linears.values())

    def names(self) -> list[str]:
        return list(self.paths)

    def register(self, name: str, path: str) -> LoRAAdapter:
        """Serve `path` as `name` (read and checked now: LoRAError says why not). A name already
        registered with another path is refused; with the same path it is a no-op."""
        known = self.paths.get(name)
        if known is not None and known != path:
            raise LoRAError(f"LoRA adapter {name!r} is already loaded from {known!r}", "lora_invalid")
        adapter = self._read(name, path)
        self.paths[name] = path
        return adapter

    def unregister(self, name: str) -> bool:
        """Stop serving `name`: forgotten, its host copy dropped, its slot emptied. False when it
        was not registered. The caller makes sure no request still runs with it."""
        if self.paths.pop(name, None) is None:
            return False
        self.resident.pop(name, None)
        if name in self.placed:
            slot = self.placed.index(name)
            place_weights(self.linears, slot, {})
            if self.mirror is not None:
                self.mirror(slot, {})
            self.placed[slot] = None
        return True

    def adapter(self, name: str) -> LoRAAdapter:
        """A registered adapter, read again from its folder if it left host memory."""
        if name not in self.paths:
            raise LoRAError(f"LoRA adapter {name!r} is not loaded", "lora_not_found")
        if name in self.resident:
            self.resident.move_to_end(name)
            return self.resident[name]
        return self._read(name, self.paths[name])

    def slots_for(self, names: Sequence[str]) -> dict[str, int]:
        """A slot for each of a step's distinct adapters (at most `max_loras`), placing the ones not
        in a slot yet where the least recently used adapter not in this step sits."""
        wanted = list(dict.fromkeys(names))
        if len(wanted) > self.max_loras:
            raise LoRAError(f"{len(wanted)} adapters in one step exceed max_loras {self.max_loras}")
        self._clock += 1
        found: dict[str, int] = {}
        for name in wanted:
            if name in self.placed:
                found[name] = self.placed.index(name)
        for name in wanted:
            if name not in found:
                free = [i for i in range(self.max_loras) if i not in found.values()]
                slot = min(free, key=lambda i: (self.placed[i] is not None, self.last_used[i]))
                self._place(slot, self.adapter(name))
                found[name] = slot
        for slot in found.values():
            self.last_used[slot] = self._clock
        return found

    def row_slots(self, names: Sequence[str | None], rows: Tensor) -> Tensor | None:
        """Each token row's slot (int64, -1: none), given each sequence's adapter and `rows` (the
        sequence index of every token row); None when no sequence has an adapter."""
        if not any(names):
            return None
        slots = self.slots_for([n for n in names if n])
        per_seq = torch.tensor([-1 if n is None else slots[n] for n in names], dtype=torch.int64)
        return per_seq.index_select(0, rows)

    def _read(self, name: str, path: str) -> LoRAAdapter:
        adapter = load_adapter(name, path, self.max_rank)
        self._check_shapes(adapter)
        self.resident[name] = adapter
        self.resident.move_to_end(name)
        while len(self.resident) > self.max_cpu_loras:
            self.resident.popitem(last=False)
        return adapter

    def _check_shapes(self, adapter: LoRAAdapter) -> None:
        """Against the whole model's projections (under tensor parallelism too: each rank's part is
        cut from a whole that fits)."""
        for (layer, module), (a, b) in adapter.weights.items():
            _, linear, _ = TARGETS[module]
            if layer >= self.num_layers:
                raise LoRAError(f"adapter {adapter.name!r} targets layer {layer}; the model has {self.num_layers}",
                                "lora_invalid")
            if (layer, linear) not in self.linears:
                raise LoRAError(f"adapter {adapter.name!r} targets {module} of layer {layer}, which this model "
                                "lacks (a sparse MoE MLP)", "lora_unsupported")
            out, into = full_shape(self.spec, module)
            if a.shape[1] != into or b.shape[0] != out:
                raise LoRAError(f"adapter {adapter.name!r} layer {layer} {module}: A {tuple(a.shape)}, "
                                f"B {tuple(b.shape)} do not fit the model's [{out}, {into}] projection "
                                "(another base model?)", "lora_invalid")

    def _place(self, slot: int, adapter: LoRAAdapter) -> None:
        place_weights(self.linears, slot, shard_weights(adapter.weights, self.shard, self.spec))
        if self.mirror is not None:
            self.mirror(slot, adapter.weights)
        self.placed[slot] = adapter.name
        log.info("lora placed", lora=adapter.name, slot=slot, rank=adapter.rank)
