"""The model runner: a scheduler output becomes one flattened, unpadded batch; block copies
and swaps run first; the model runs once; logits come back for the rows that sample."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor

import ops
from engine.kv.block_manager import BlockManager
from engine.model.attention import AttentionMetadata
from engine.model.llama import LlamaForCausalLM
from engine.sched.scheduler import ScheduledSeq, SchedulerOutput

KVCaches = list[tuple[Tensor, Tensor]]


@dataclass(slots=True)
class StepBatch:
    """The tensors of one step, plus which scheduled sequences produce a logits row."""

    input_ids: Tensor
    positions: Tensor
    meta: AttentionMetadata
    sample_rows: list[int]  # flat token index of each sampling sequence's last token
    sampling: list[ScheduledSeq]


class ModelRunner:
    """Owns the device KV caches and the host swap caches; runs one step at a time."""

    def __init__(self, model: LlamaForCausalLM, kv_caches: KVCaches, cpu_caches: KVCaches,
                 block_size: int, device: torch.device) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.cpu_caches = cpu_caches
        self.block_size = block_size
        self.device = device
        self.model_seconds = 0.0  # cumulative time inside the model (forward + logits)

    def execute(self, sched: SchedulerOutput, block_manager: BlockManager) -> tuple[list[ScheduledSeq], Tensor]:
        """Move blocks, run the model; returns the sampling sequences and their fp32 logits."""
        self.move_blocks(sched)
        batch = self.prepare(sched.scheduled, block_manager)
        start = time.perf_counter()
        hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta)
        if not batch.sample_rows:
            logits = hidden.new_empty((0, 0), dtype=torch.float32)
        else:
            rows = torch.tensor(batch.sample_rows, device=hidden.device)
            logits = self.model.compute_logits(hidden.index_select(0, rows))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.model_seconds += time.perf_counter() - start
        return batch.sampling, logits

    def move_blocks(self, sched: SchedulerOutput) -> None:
        """Swap-outs first (their device blocks may be reused this step), then swap-ins, then CoW."""
        if sched.blocks_to_swap_out:
            self._swap(self.kv_caches, self.cpu_caches, sched.blocks_to_swap_out)
        if sched.blocks_to_swap_in:
            self._swap(self.cpu_caches, self.kv_caches, sched.blocks_to_swap_in)
        if sched.blocks_to_copy:
            mapping = torch.tensor(sched.blocks_to_copy, dtype=torch.int64, device=self.device)
            ops.copy_blocks([k for k, _ in self.kv_caches], [v for _, v in self.kv_caches], mapping)

    def _swap(self, src: KVCaches, dst: KVCaches, pairs: list[tuple[int, int]]) -> None:
        mapping = torch.tensor(pairs, dtype=torch.int64)
        for (src_k, src_v), (dst_k, dst_v) in zip(src, dst, strict=True):
            ops.swap_blocks(src_k, dst_k, mapping)
            ops.swap_blocks(src_v, dst_v, mapping)

    def prepare(self, scheduled: list[ScheduledSeq], block_manager: BlockManager) -> StepBatch:
        """Prefill chunks (more than one new token) first, then one token per decode sequence."""
        prefills = [s for s in scheduled if s.num_new > 1]
        decodes = [s for s in scheduled if s.num_new == 1]
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        sampling: list[ScheduledSeq] = []
        query_start = [0]
        for item in prefills + decodes:
            seq, start = item.seq, item.seq.num_computed
            end = start + item.num_new
            table = block_manager.block_table(seq.seq_id)
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            if end == len(seq.token_ids):
                sample_rows.append(len(input_ids) - 1)
                sampling.append(item)
            if item.num_new > 1:
                query_start.append(len(input_ids))
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots, torch.int64),
            num_prefills=len(prefills),
            num_prefill_tokens=query_start[-1],
            prefill_query_start=query_start,
            prefill_context_lens=[s.seq.num_computed + s.num_new for s in prefills],
            prefill_block_tables=self._block_tables([block_manager.block_table(s.seq.seq_id) for s in prefills]),
            decode_block_tables=self._block_tables([block_manager.block_table(s.seq.seq_id) for s in decodes]),
            decode_context_lens=self._tensor([s.seq.num_computed + 1 for s in decodes], torch.int32),
        )
        return StepBatch(self._tensor(input_ids, torch.int64), self._tensor(positions, torch.int64),
                         meta, sample_rows, sampling)

    def _tensor(self, values: list[int], dtype: torch.dtype) -> Tensor:
        return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

    def _block_tables(self, tables: list[list[int]]) -> Tensor:
        width = max((len(t) for t in tables), default=0)
        padded = [t + [0] * (width - len(t)) for t in tables]
        return torch.tensor(padded, dtype=torch.int32).reshape(len(tables), width).to(self.device)
