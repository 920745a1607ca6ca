"""The adapters of one linear layer stacked in slots (`LoRASlots`), and one step's rows that carry
an adapter (`LoRARows`): `y[row] += (x[row] @ A[slot].T) @ B[slot].T` for every such row at once,
with no loop over adapters.

Each row's product is gathered from its slot and reduced on its own (an elementwise product
summed over the contiguous last dimension, whose order depends only on that dimension's length),
so a row's result is the same whatever other rows, adapters or row counts share its step: the
batch invariance of the deterministic mode holds with adapters. On the CPU in fp32 the kernel
``ops.lora.lora_rows`` does the same per row in one fixed order; the torch path serves the other
devices, dtypes and the reference backend."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ops.lora import kernel_applies, lora_rows
from ops.policy import FASTEST, OpsPolicy

GATHER_ELEMENTS = 1 << 21  # elements of a gathered chunk of adapter weights (8 MiB in fp32)


@dataclass(frozen=True, slots=True)
class LoRARows:
    """The rows of a step with an adapter: `index` (int64 [n], sorted) and their `slot` (int64 [n]);
    `every_row` when they are all the step's rows, in order."""

    index: Tensor
    slot: Tensor
    every_row: bool

    @staticmethod
    def of(row_slots: Tensor | None) -> LoRARows | None:
        """From a step's per-row slots (int64 [T], -1: no adapter); None when no row has one."""
        if row_slots is None:
            return None
        has = row_slots >= 0
        if not bool(has.any()):
            return None
        if bool(has.all()):
            return LoRARows(torch.arange(row_slots.shape[0], device=row_slots.device), row_slots, True)
        index = has.nonzero().squeeze(1)
        return LoRARows(index, row_slots.index_select(0, index), False)


class LoRASlots:
    """`num_slots` adapters of a linear whose output is the concatenation of `slice_sizes` (q, k, v
    or gate, up stacked in one weight; one slice otherwise). A slot holds, per slice, A `[rank, in]`
    stacked into `a [slots, S * rank, in]` and B `[out_s, rank]` in `b[s] [slots, out_s, rank]`
    (zeros where the adapter leaves a slice out, and past its own rank)."""

    def __init__(self, in_features: int, slice_sizes: list[int], num_slots: int, rank: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.in_features = in_features
        self.slice_sizes = slice_sizes
        self.rank = rank
        self.a = torch.zeros((num_slots, len(slice_sizes) * rank, in_features), dtype=dtype, device=device)
        self.b = [torch.zeros((num_slots, size, rank), dtype=dtype, device=device) for size in slice_sizes]

    @property
    def nbytes_per_slot(self) -> int:
        per = self.a[0].numel() + sum(b[0].numel() for b in self.b)
        return per * self.a.element_size()

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        for b in self.b:
            b[slot].zero_()

    def set(self, slot: int, part: int, a: Tensor, b: Tensor) -> None:
        """Slice `part` of `slot`: A `[r, in]`, B `[out_part, r]` (r <= rank; the rest stays zero)."""
        r = a.shape[0]
        self.a[slot, part * self.rank : part * self.rank + r].copy_(a)
        self.b[part][slot, :, :r].copy_(b)

    def add(self, x: Tensor, out: Tensor, rows: LoRARows, policy: OpsPolicy = FASTEST) -> Tensor:
        """`out` (the base linear's `[T, out]`) plus each adapter row's product, in place (on the CPU
        kernel unless `policy` asks for the reference); returns `out`."""
        if kernel_applies(out, x, self.a, policy):
            return self._add_kernel(x, out, rows)
        xs = x if rows.every_row else x.index_select(0, rows.index)
        xs = xs.to(self.a.dtype)
        widest = max(self.in_features, *self.slice_sizes) * self.a.shape[1]
        step = max(1, GATHER_ELEMENTS // widest)
        deltas = [self._delta(xs[i : i + step], rows.slot[i : i + step]) for i in range(0, xs.shape[0], step)]
        delta = (deltas[0] if len(deltas) == 1 else torch.cat(deltas)).to(out.dtype)
        if rows.every_row:
            return out.add_(delta)
        return out.index_add_(0, rows.index, delta)

    def _add_kernel(self, x: Tensor, out: Tensor, rows: LoRARows) -> Tensor:
        """`add` through the CPU kernel: every row at once, slice by slice, no gathered copies."""
        if rows.every_row:
            slot_of_row = rows.slot
        else:
            slot_of_row = torch.full((x.shape[0],), -1, dtype=torch.int64).index_copy_(0, rows.index, rows.slot)
        r, start = self.rank, 0
        for i, b in enumerate(self.b):
            size = b.shape[1]
            lora_rows(out[:, start : start + size], x, self.a[:, i * r : (i + 1) * r], b, slot_of_row)
            start += size
        return out

    def _delta(self, x: Tensor, slot: Tensor) -> Tensor:
        """`[n, out]`: each row through its own slot's A then B."""
        h = (self.a.index_select(0, slot) * x.unsqueeze(1)).sum(-1)  # [n, S * rank]
        r = self.rank
        parts = [(b.index_select(0, slot) * h[:, None, i * r : (i + 1) * r]).sum(-1) for i, b in enumerate(self.b)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
