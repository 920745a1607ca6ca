"""One step's model inputs on the host: what the runner builds from a scheduler output, and what
rank 0 of a tensor-parallel group sends the other ranks (`engine.parallel.step_message`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from engine.model.attention import AttentionMetadata


@dataclass(slots=True, kw_only=True)
class StepInputs:
    """Host (CPU) tensors of one step: the model's inputs and the block moves that run before it."""

    input_ids: Tensor  # int64 [T]
    positions: Tensor  # int64 [T]
    slots: Tensor  # int64 [T], -1 = do not write
    prefill_query_start: list[int]  # [P + 1]
    prefill_context_lens: list[int]  # [P]
    block_tables: Tensor  # int32 [P + D, width], prefill rows first, then one per decode row
    decode_context_lens: Tensor  # int32 [D]: decode rows (a speculative row of k proposals is 1 + k of them)
    swap_out: list[tuple[int, int]]
    swap_in: list[tuple[int, int]]
    copy: list[tuple[int, int]]
    prefill_exact_lens: list[int] | None = None  # [P]: leading rows of each chunk at prompt positions; None: all
    lora_slots: Tensor | None = None  # int64 [T]: each row's LoRA adapter slot (-1: none); None: no adapters

    @property
    def num_prefills(self) -> int:
        return len(self.prefill_context_lens)

    @property
    def exact_ranges(self) -> tuple[tuple[int, int], ...] | None:
        """The prompt tokens' row ranges where they are not all the prefill rows (a recomputed
        sequence's generated tokens: `AttentionMetadata.exact_ranges`); else None."""
        lens = self.prefill_exact_lens
        starts = self.prefill_query_start
        if lens is None or all(n == end - start for n, start, end in zip(lens, starts, starts[1:], strict=False)):
            return None
        ranges: list[tuple[int, int]] = []
        for n, start in zip(lens, starts, strict=False):
            if not n:
                continue
            if ranges and ranges[-1][1] == start:
                ranges[-1] = (ranges[-1][0], start + n)
            else:
                ranges.append((start, start + n))
        return tuple(ranges)

    def metadata(self, device: torch.device) -> AttentionMetadata:
        """The attention layers' view of the step, on `device` (one place, so a new field is added here only)."""
        p = self.num_prefills
        return AttentionMetadata(
            slot_mapping=_to(self.slots, device), num_prefills=p, num_prefill_tokens=self.prefill_query_start[-1],
            prefill_query_start=self.prefill_query_start, prefill_context_lens=self.prefill_context_lens,
            prefill_block_tables=_to(self.block_tables[:p], device),
            decode_block_tables=_to(self.block_tables[p:], device),
            decode_context_lens=_to(self.decode_context_lens, device), exact_ranges=self.exact_ranges,
            lora_slots=None if self.lora_slots is None else _to(self.lora_slots, device),
        )


def _to(tensor: Tensor, device: torch.device) -> Tensor:
    return tensor if device.type == "cpu" else tensor.to(device, non_blocking=True)
