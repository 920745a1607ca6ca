"""The model runner: a scheduler output becomes one flattened, unpadded batch; block copies
and swaps run first; the model runs once; what the step's plan (`engine.sample.step_plan`) asks
comes back: the model's head and the hidden states of the rows that sample (the sampling stage,
`engine.sample`, takes their logits and tokens from the head).

It reads only the scheduler's output (`engine.sched.output`): token ids, start positions and
block tables. Slots are computed in bulk from the step's block-table tensor, which persists
across steps (`BlockTableBuffer`).

A speculative row (`ScheduledSeq.num_spec` = k) runs among the decodes as 1 + k decode rows over
the same block table, with context lengths L + 1 .. L + 1 + k: each position's attention sums run
in exactly the order plain decoding runs them (bit for bit, so no near tie breaks differently in
attention). Each of the k + 1 positions' hidden states comes back (`ModelOutput.spec_hidden`):
the sampling stage takes each position's token by the plan's `spec_picker`."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate, chain

import torch
from torch import Tensor

import ops
from engine.model.attention import AttentionMetadata
from engine.model.llama import LlamaForCausalLM
from engine.model.lora.manager import LoRAManager
from engine.model.step_inputs import StepInputs
from engine.sample.step_plan import ModelOutput, StepPlan
from engine.sched.output import ScheduledSeq, SchedulerOutput, batch_order, is_prefill

KVCaches = list[tuple[Tensor, Tensor]]
StepPublisher = Callable[[StepInputs], None]  # rank 0 of a tensor-parallel group: send the step to the others


@dataclass(slots=True, kw_only=True)
class StepBatch:
    """The tensors of one step, plus which rows produce logits."""

    input_ids: Tensor
    positions: Tensor
    meta: AttentionMetadata
    inputs: StepInputs  # the host tensors the three above were made from
    sample_rows: Tensor | None  # flat index of each sampling chunk's last token; None = every row, in order
    sampling: list[ScheduledSeq]  # the chunks those rows belong to
    prompt_rows: list[tuple[ScheduledSeq, int]]  # chunks keeping prompt-logit rows, with their first flat row
    spec_rows: Tensor | None = None  # flat index of every position of the speculative rows, in order


class BlockTableBuffer:
    """The step's block tables as one int32 tensor, kept across steps: rebuilt when the step's
    sequences (or their order) change, else patched only where a table grew by a block or its
    last block was copied on write; a table never changes otherwise while it stays scheduled,
    except around a speculative row (its table may be cut back after verification and regrow with
    other blocks): such a row is rewritten in the step it runs and in the next."""

    def __init__(self) -> None:
        self.key: tuple[int, ...] = ()
        self.buffer = torch.zeros((0, 0), dtype=torch.int32)
        self.lens: list[int] = []
        self.lasts: list[int] = []
        self.spec: list[bool] = []

    def build(self, order: list[ScheduledSeq]) -> Tensor:
        key = tuple(s.seq.seq_id for s in order)
        tables = [s.block_table for s in order]
        width = max((len(t) for t in tables), default=0)
        if key != self.key or width > self.buffer.shape[1]:
            width = -(-width // 8) * 8  # room to grow before the next rebuild
            rows = [t + [0] * (width - len(t)) for t in tables]
            self.buffer = torch.tensor(rows, dtype=torch.int32).reshape(len(tables), width)
            self.key = key
        else:
            for i, table in enumerate(tables):
                if len(table) != self.lens[i] or table[-1] != self.lasts[i] or self.spec[i] or order[i].num_spec:
                    self.buffer[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
        self.lens = [len(t) for t in tables]
        self.lasts = [t[-1] if t else -1 for t in tables]
        self.spec = [s.num_spec > 0 for s in order]
        return self.buffer


class ModelRunner:
    """Owns the device KV caches and the host swap caches; runs one step at a time.

    Under tensor parallelism every rank has one, over its own heads' caches: rank 0's `execute`
    builds the step and hands its `StepInputs` to `publish` before running it; the other ranks
    run what they receive with `run_inputs`."""

    def __init__(self, model: LlamaForCausalLM, kv_caches: KVCaches, cpu_caches: KVCaches,
                 block_size: int, device: torch.device, publish: StepPublisher | None = None) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.cpu_caches = cpu_caches
        self.block_size = block_size
        self.device = device
        self.publish = publish
        self.tables = BlockTableBuffer()
        self.lora: LoRAManager | None = None  # the adapters' slots, where LoRA is enabled
        self.model_seconds = 0.0  # cumulative time in the model's forward (its lm_head's: `SampleStage.head_seconds`)
        self.publish_seconds = 0.0  # cumulative time handing steps to the other ranks

    def run_inputs(self, inputs: StepInputs) -> Tensor:
        """Move blocks and run the model over `inputs` (a rank other than 0); the hidden states."""
        self.move_blocks(inputs)
        return self.model(_on(inputs.input_ids, self.device), _on(inputs.positions, self.device), self.kv_caches,
                          inputs.metadata(self.device))

    def execute(self, sched: SchedulerOutput, plan: StepPlan) -> ModelOutput:
        """Move blocks, run the model; the model's head, the hidden states of the plan's sampling
        rows and of every speculative position (the sampling stage takes their logits and tokens
        from the head), and those of the rows that predict prompt tokens and of the pooling chunks."""
        batch = self.prepare(sched.scheduled, sched)
        if self.publish is not None:
            sent = time.perf_counter()
            self.publish(batch.inputs)
            self.publish_seconds += time.perf_counter() - sent
        self.move_blocks(batch.inputs)
        start = time.perf_counter()
        hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta)  # exact ranges: in meta
        if self.device.type == "cuda" and not plan.sampling and batch.spec_rows is None:
            torch.cuda.synchronize(self.device)  # else the sampling stage waits, after the lm_head's kernels
        self.model_seconds += time.perf_counter() - start
        out = ModelOutput(self.model.head)
        if plan.sampling:
            out.sample_hidden = hidden if batch.sample_rows is None else hidden.index_select(0, batch.sample_rows)
        if batch.spec_rows is not None:
            out.spec_hidden = hidden.index_select(0, batch.spec_rows)
        out.prompt_hidden = [(s, hidden[first : first + s.num_prompt_logits]) for s, first in batch.prompt_rows]
        if plan.pooling:
            out.pooled_hidden = _chunk_rows(hidden, sched.scheduled, plan.pooling)
        return out

    def move_blocks(self, inputs: StepInputs) -> None:
        """Swap-outs first (their device blocks may be reused this step), then swap-ins, then CoW."""
        if inputs.swap_out:
            self._swap(self.kv_caches, self.cpu_caches, inputs.swap_out)
        if inputs.swap_in:
            self._swap(self.cpu_caches, self.kv_caches, inputs.swap_in)
        if inputs.copy:
            mapping = torch.tensor(inputs.copy, dtype=torch.int64, device=self.device)
            ops.copy_blocks([k for k, _ in self.kv_caches], [v for _, v in self.kv_caches], mapping,
                            policy=self.model.policy.ops)

    def _swap(self, src: KVCaches, dst: KVCaches, pairs: list[tuple[int, int]]) -> None:
        mapping = torch.tensor(pairs, dtype=torch.int64)
        for (src_k, src_v), (dst_k, dst_v) in zip(src, dst, strict=True):
            ops.swap_blocks(src_k, dst_k, mapping, policy=self.model.policy.ops)
            ops.swap_blocks(src_v, dst_v, mapping, policy=self.model.policy.ops)

    def prepare(self, scheduled: list[ScheduledSeq], sched: SchedulerOutput | None = None) -> StepBatch:
        """Prefill chunks first, then one decode row per decode sequence and 1 + k per speculative
        row (each with its sequence's block table, context length = position + 1); positions and
        slots computed in bulk from the block-table tensor; the block moves of `sched`."""
        order = batch_order(scheduled)
        num_prefills = sum(1 for s in order if is_prefill(s))
        counts = [len(s.token_ids) for s in order]
        ends = list(accumulate(counts))
        num_tokens = ends[-1] if ends else 0
        tables = self.tables.build(order)
        starts = torch.tensor([s.start for s in order], dtype=torch.int64)
        if num_tokens == len(order):  # decode only: one token per row
            rows, positions = torch.arange(len(order)), starts
        else:
            rows = torch.repeat_interleave(torch.arange(len(order)), torch.tensor(counts))
            firsts = torch.tensor([e - c for e, c in zip(ends, counts, strict=True)], dtype=torch.int64)
            positions = starts[rows] + torch.arange(num_tokens) - firsts[rows]
        bs = self.block_size
        slots = tables[rows, positions // bs].long() * bs + positions % bs
        if any(s.write_from for s in order):
            keep = torch.tensor([s.write_from for s in order], dtype=torch.int64)
            slots.masked_fill_(positions < keep[rows], -1)
        sampling = [s for s in order if s.sample]
        all_rows = len(sampling) == len(order) == num_tokens
        sample_rows = None if all_rows else torch.tensor(
            [e - 1 for s, e in zip(order, ends, strict=True) if s.sample], dtype=torch.int64)
        prompt_rows = [(s, e - c) for s, e, c in zip(order, ends, counts, strict=True) if s.num_prompt_logits]
        spec = any(s.num_spec for s in order)
        spec_rows = torch.tensor([r for s, e in zip(order, ends, strict=True) if s.num_spec
                                  for r in range(e - 1 - s.num_spec, e)], dtype=torch.int64) if spec else None
        input_ids = torch.tensor(list(chain.from_iterable(s.token_ids for s in order)), dtype=torch.int64)
        prefill_tokens = ends[num_prefills - 1] if num_prefills else 0
        if spec:  # a decode row per token: speculative rows repeat their table
            tables = torch.cat([tables[:num_prefills], tables.index_select(0, rows[prefill_tokens:])])
        inputs = StepInputs(
            input_ids=input_ids, positions=positions, slots=slots, prefill_query_start=[0, *ends[:num_prefills]],
            prefill_context_lens=[s.start + len(s.token_ids) for s in order[:num_prefills]], block_tables=tables,
            decode_context_lens=(positions[prefill_tokens:] + 1).to(torch.int32),
            swap_out=list(sched.blocks_to_swap_out) if sched else [],
            swap_in=list(sched.blocks_to_swap_in) if sched else [],
            copy=list(sched.blocks_to_copy) if sched else [],
            prefill_exact_lens=[max(0, min(c, s.seq.num_prompt_tokens - s.start))
                                for s, c in zip(order[:num_prefills], counts, strict=False)] or None,
            lora_slots=None if self.lora is None else self.lora.row_slots([s.lora_name for s in order], rows))
        return StepBatch(input_ids=_on(input_ids, self.device), positions=_on(positions, self.device),
                         meta=inputs.metadata(self.device), inputs=inputs,
                         sample_rows=None if sample_rows is None else _on(sample_rows, self.device),
                         sampling=sampling, prompt_rows=prompt_rows,
                         spec_rows=None if spec_rows is None else _on(spec_rows, self.device))


def _chunk_rows(hidden: Tensor, scheduled: list[ScheduledSeq],
                chunks: tuple[ScheduledSeq, ...]) -> list[tuple[ScheduledSeq, Tensor]]:
    """Each of `chunks`' rows of the step's hidden states (laid out in `batch_order`)."""
    first: dict[int, int] = {}
    row = 0
    for s in batch_order(scheduled):
        first[id(s)] = row
        row += len(s.token_ids)
    return [(s, hidden[first[id(s)] : first[id(s)] + len(s.token_ids)]) for s in chunks]


def _on(tensor: Tensor, device: torch.device) -> Tensor:
    return tensor if device.type == "cpu" else tensor.to(device, non_blocking=True)

