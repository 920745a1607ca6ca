"""The other ranks' adapter slots under tensor parallelism. Rank 0 alone reads, checks and keeps
adapters (`LoRAManager`); each time it places one in a slot (or empties a slot) it sends the
adapter's whole weights to ranks 1..N-1 as one int64 message (`encode`), and each of them puts its
own part in the same slot (`RankLoRA`). A step's rows then name the same slot on every rank.

Sending the weights, not the folder's path, keeps every rank on the very tensors rank 0 checked
(a folder may change or vanish after it was read). Layout: `[slot, n]`, then per weight pair
`[layer, module, A rows, A cols, B rows, B cols]`, then every A and B in that order as fp32
values, two to an int64 (zero-padded to an even count). `n = 0` empties the slot."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from engine.model.lora.placement import TARGETS, Weights, attach_slots, place_weights, shard_weights

MODULES = tuple(TARGETS)  # a PEFT module's number on the wire
_FIELDS = 6  # int64 values describing one weight pair


def encode(slot: int, weights: Weights) -> Tensor:
    """The message placing `weights` (fp32, whole) in `slot` on the other ranks (int64, CPU)."""
    items = sorted(weights.items())
    head = [slot, len(items)]
    values: list[Tensor] = []
    for (layer, module), (a, b) in items:
        head += [layer, MODULES.index(module), *a.shape, *b.shape]
        values += [a.detach().reshape(-1).float().cpu(), b.detach().reshape(-1).float().cpu()]
    data = torch.cat(values) if values else torch.empty(0)
    if data.numel() % 2:
        data = torch.cat([data, torch.zeros(1)])
    return torch.cat([torch.tensor(head, dtype=torch.int64), data.view(torch.int64)])


def decode(payload: Tensor) -> tuple[int, Weights]:
    """`(slot, weights)` of an `encode` message."""
    slot, count = int(payload[0]), int(payload[1])
    head = payload[2 : 2 + _FIELDS * count].tolist()
    data = payload[2 + _FIELDS * count :].clone().view(torch.float32)
    weights: Weights = {}
    offset = 0
    for i in range(count):
        layer, module, a_rows, a_cols, b_rows, b_cols = head[_FIELDS * i : _FIELDS * (i + 1)]
        a = data[offset : offset + a_rows * a_cols].view(a_rows, a_cols)
        offset += a_rows * a_cols
        b = data[offset : offset + b_rows * b_cols].view(b_rows, b_cols)
        offset += b_rows * b_cols
        weights[(layer, MODULES[module])] = (a, b)
    return slot, weights


class RankLoRA:
    """The adapter slots of a rank other than 0 (as many as rank 0's, sized alike)."""

    def __init__(self, model: Any, max_loras: int, max_rank: int) -> None:
        self.linears = attach_slots(model, max_loras, max_rank)
        self.shard, self.spec = model.shard, model.spec

    def apply(self, payload: Tensor) -> None:
        """Place what rank 0 placed (an `encode` message), cut to this rank's part."""
        slot, weights = decode(payload)
        place_weights(self.linears, slot, shard_weights(weights, self.shard, self.spec))
