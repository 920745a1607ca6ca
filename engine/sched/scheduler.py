"""Iteration-level (continuous) batching, FCFS, over three queues: running, swapped, waiting.

Each step: running requests get their next tokens (preempting the newest running request
when the pool is dry), then swapped requests come back, then waiting ones are admitted while
memory and the token budget allow. Prompts longer than the token budget are chunked.
After the step, `update_from_output` applies the sampled tokens (see `postprocess`).

With a `Proposer` (`engine.spec.speculator`), a decoding sequence may run as 1 + k tokens: its
last token and k n-gram proposals, whose slots are reserved here (`BlockManager.append_slot`)
and cut back after verification (`BlockManager.truncate`). Proposals fit the step's token
budget and leave free a block per queued sequence (so they never cause a preemption)."""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass

from common.log import get_logger
from engine.kv.block_manager import BlockManager
from engine.outputs import RequestOutput
from engine.sched.output import ScheduledSeq, SchedulerOutput, StepSamples
from engine.sched.postprocess import Postprocessor
from engine.sched.proposer import Proposer
from engine.sched.sequence import Request, SeqStatus, Sequence

log = get_logger("scheduler")


@dataclass(slots=True)
class _Budget:
    tokens: int
    seqs: int

    def fits(self, num_seqs: int, num_seqs_at_peak: int | None = None) -> bool:
        """Room for `num_seqs` rows now, and `num_seqs_at_peak` sequences once they fork."""
        return self.seqs >= max(num_seqs, num_seqs_at_peak or 0) and self.tokens >= num_seqs


class Scheduler:
    """Decides, each step, which tokens of which sequences run, and moves blocks accordingly."""

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        preemption_mode: str = "auto",
        eos_token_ids: set[int] | None = None,
        max_model_len: int = 1 << 30,
        speculator: Proposer | None = None,
        max_loras: int = 0,
    ) -> None:
        """`max_loras` > 0: no step holds requests of more distinct LoRA adapters than that."""
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.preemption_mode = preemption_mode
        self.waiting: deque[Request] = deque()
        self.running: deque[Request] = deque()
        self.swapped: deque[Request] = deque()
        self.num_preemptions: Counter[str] = Counter()
        self.max_model_len = max_model_len
        self.post = Postprocessor(block_manager, eos_token_ids or set(), max_model_len)
        self.speculator = speculator
        self._speculate = False  # this step may propose (decided at the start of `schedule`)
        self._num_queued = 0  # sequences in every queue at the start of the step
        self.max_loras = max_loras

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def abort(self, request: Request) -> None:
        """Drop a request from whichever queue holds it and free its blocks."""
        for queue in (self.waiting, self.running, self.swapped):
            if request in queue:
                queue.remove(request)
        for seq in request.seqs:
            self.free_seq(seq)

    def free_seq(self, seq: Sequence) -> None:
        if self.speculator is not None:
            self.speculator.release(seq)
        if self.block_manager.has_seq(seq.seq_id):
            self.block_manager.free(seq.seq_id)

    def finish_request(self, request: Request) -> None:
        """Remove a finished request from the running queue and free what it still holds."""
        if request in self.running:
            self.running.remove(request)
        for seq in request.seqs:
            self.free_seq(seq)

    def update_from_output(self, sched: SchedulerOutput, samples: StepSamples) -> list[RequestOutput]:
        """Apply one step's results to the sequences, release what finished, and return the
        step's deltas (refusals included)."""
        update = self.post.update(sched, samples)
        if self.speculator is not None:
            for result in samples.spec:
                self.speculator.record(result.seq, result.num_proposed, result.num_accepted)
        for seq in update.finished_seqs:
            self.free_seq(seq)
        for request in update.finished_requests:
            self.finish_request(request)
        return update.outputs

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = _Budget(self.max_num_batched_tokens, self.max_num_seqs)
        self._num_queued = self._num_seqs()
        self._speculate = self.speculator is not None and self.speculator.allows_batch(self._num_queued)
        preempted = self._schedule_running(out, budget)
        if not preempted:
            self._schedule_swapped(out, budget)
            if not self.swapped:
                self._schedule_waiting(out, budget)
        return out

    # ----- running -------------------------------------------------------------------------
    def _schedule_running(self, out: SchedulerOutput, budget: _Budget) -> bool:
        queue, self.running = self.running, deque()
        preempted = False
        while queue:
            request = queue.popleft()
            seqs = request.unfinished_seqs()
            peak = request.num_seqs_at_peak  # a prompt still in chunks forks into n at its first token
            if not budget.fits(len(seqs), peak):
                self.running.append(request)
                budget.seqs -= peak  # its rows stay reserved: nothing admitted behind it may take them
                continue
            ids = [seq.seq_id for seq in seqs]
            while not self.block_manager.can_append_slots(ids):
                preempted = True
                if not queue:
                    self._preempt(request, out)
                    return True
                self._preempt(queue.pop(), out)
            self._append_slots(seqs, out)
            self._schedule_tokens(seqs, out, budget)
            budget.seqs -= peak - len(seqs)
            self.running.append(request)
        return preempted

    def _append_slots(self, seqs: list[Sequence], out: SchedulerOutput) -> None:
        for seq in seqs:
            if self.block_manager.num_tokens(seq.seq_id) < len(seq.token_ids):
                copy = self.block_manager.append_slot(seq.seq_id, seq.token_ids[-1])
                if copy is not None:
                    out.blocks_to_copy.append(copy)

    def _schedule_tokens(self, seqs: list[Sequence], out: SchedulerOutput, budget: _Budget) -> None:
        donor = self._prefix_donor(seqs)
        for seq in seqs:
            if donor is not None and seq is not donor:
                budget.seqs -= 1  # its first blocks are the donor's, not computed yet: it waits, its row kept
                continue
            start = seq.num_computed
            limit = len(seq.token_ids) if donor is None else seq.request.num_shared_prefix
            end = min(limit, start + budget.tokens)
            if end <= start or budget.seqs <= 0:
                continue
            prompt_rows = 0
            if seq.request.needs_prompt_logprobs:
                prompt_rows = max(0, min(end, seq.num_prompt_tokens - 1) - start)
            self.block_manager.release_behind(seq.seq_id, start)  # no query from `start` on sees them
            table = self.block_manager.block_table(seq.seq_id)
            proposals = self._proposals(seq, budget) if end - start == 1 and end == len(seq.token_ids) else []
            if proposals:
                for token in proposals:
                    copy = self.block_manager.append_slot(seq.seq_id, token)
                    if copy is not None:
                        out.blocks_to_copy.append(copy)
                out.scheduled.append(ScheduledSeq(seq=seq, token_ids=seq.token_ids[start:end] + proposals,
                                                  start=start, block_table=table, sample=False,
                                                  write_from=seq.keep_kv_below, num_spec=len(proposals)))
            else:
                samples = end == len(seq.token_ids) and seq.request.pooling is None  # pooling: no token
                out.scheduled.append(ScheduledSeq(seq=seq, token_ids=seq.token_ids[start:end], start=start,
                                                  block_table=table, sample=samples,
                                                  write_from=seq.keep_kv_below, num_prompt_logits=prompt_rows))
            out.scheduled[-1].lora_name = seq.request.lora_name
            budget.tokens -= end - start + len(proposals)
            budget.seqs -= 1

    @staticmethod
    def _prefix_donor(seqs: list[Sequence]) -> Sequence | None:
        """The sequence that must compute a recomputed group's shared prompt blocks first (see
        `_allocate`), or None once it has (or the group shares nothing)."""
        if not seqs:
            return None
        request = seqs[0].request
        donor = request.prefix_donor
        if donor is not None and (donor.num_computed >= request.num_shared_prefix or donor not in seqs):
            request.prefix_donor = donor = None
        return donor

    def _num_seqs(self) -> int:
        """Sequences in every queue: what the next steps will batch."""
        return sum(len(request.unfinished_seqs()) for queue in (self.running, self.swapped, self.waiting)
                   for request in queue)

    def _proposals(self, seq: Sequence, budget: _Budget) -> list[int]:
        """Speculative tokens for a decoding sequence: within the token budget, max_tokens and
        max_model_len, and only from blocks that leave one per running sequence to grow."""
        if not self._speculate or self.speculator is None or seq.num_output_tokens == 0:
            return []
        limit = min(budget.tokens - 1, seq.request.params.max_tokens - seq.num_output_tokens - 1,
                    self.max_model_len - len(seq.token_ids) - 1)
        proposals = self.speculator.propose(seq, limit)
        manager = self.block_manager
        reserve = manager.watermark_blocks + self._num_queued + 1
        while proposals and manager.num_free_blocks - manager.num_blocks_to_grow(seq.seq_id, len(proposals)) < reserve:
            proposals.pop()
        return proposals

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        seqs = request.unfinished_seqs()
        ids = [seq.seq_id for seq in seqs]
        mode = self.preemption_mode
        if mode == "auto":
            mode = "recompute" if len(seqs) == 1 else "swap"
        if mode == "swap" and not self.block_manager.can_swap_out(ids):
            mode = "recompute"  # no host room left: recompute is the only way out
        if mode == "swap":
            out.blocks_to_swap_out.extend(self.block_manager.swap_out(ids))
            for seq in seqs:
                seq.status = SeqStatus.SWAPPED
            self.swapped.append(request)
        else:
            for seq in seqs:
                self.block_manager.free(seq.seq_id)
                seq.num_computed = 0
                seq.status = SeqStatus.WAITING
            self.waiting.appendleft(request)
        self.num_preemptions[mode] += 1
        log.info("preempt", request_id=request.request_id, mode=mode, num_seqs=len(seqs))

    # ----- swapped -------------------------------------------------------------------------
    def _lora_fits(self, request: Request) -> bool:
        """Whether `request` may run beside the running requests without their distinct LoRA
        adapters exceeding `max_loras` (the model's adapter slots)."""
        if not self.max_loras or request.lora_name is None:
            return True
        running = {r.lora_name for r in self.running if r.lora_name is not None}
        return request.lora_name in running or len(running) < self.max_loras

    def _schedule_swapped(self, out: SchedulerOutput, budget: _Budget) -> None:
        while self.swapped:
            request = self.swapped[0]
            seqs = request.unfinished_seqs()
            ids = [seq.seq_id for seq in seqs]
            peak = request.num_seqs_at_peak
            if not budget.fits(len(seqs), peak) or not self.block_manager.can_swap_in(ids) or not self._lora_fits(
                    request):
                return
            self.swapped.popleft()
            out.blocks_to_swap_in.extend(self.block_manager.swap_in(ids))
            for seq in seqs:
                seq.status = SeqStatus.RUNNING
            self._append_slots(seqs, out)
            self._schedule_tokens(seqs, out, budget)
            budget.seqs -= peak - len(seqs)
            self.running.append(request)

    # ----- waiting -------------------------------------------------------------------------
    def _schedule_waiting(self, out: SchedulerOutput, budget: _Budget) -> None:
        """Admit waiting requests in order; one whose adapter finds no slot this step (`_lora_fits`)
        is passed over, keeping its place at the head for the next step."""
        passed: list[Request] = []
        try:
            self._admit_waiting(out, budget, passed)
        finally:
            self.waiting.extendleft(reversed(passed))

    def _admit_waiting(self, out: SchedulerOutput, budget: _Budget, passed: list[Request]) -> None:
        while self.waiting and budget.tokens > 0:
            request = self.waiting[0]
            if not self._lora_fits(request):
                passed.append(self.waiting.popleft())
                continue
            seqs = request.unfinished_seqs()
            peak = request.num_seqs_at_peak
            if not budget.fits(len(seqs), peak):
                return
            if not all(self.block_manager.can_ever_allocate(len(seq.token_ids) + 1) for seq in seqs):
                self.waiting.popleft()
                request.error = (
                    f"prompt of {len(seqs[0].token_ids)} tokens can never fit in the KV cache "
                    f"({self.block_manager.num_blocks} blocks of {self.block_manager.block_size} tokens)"
                )
                request.error_code = "context_length_exceeded"
                out.rejected.append(request)
                continue
            if not self._fits_apart(seqs):
                self.waiting.popleft()
                request.error = (
                    f"preempted by recompute after it forked: its {len(seqs)} sequences cannot fit the KV "
                    f"cache together ({self.block_manager.num_blocks} blocks); lower n, best_of or max_tokens")
                request.error_code = "context_length_exceeded"
                out.rejected.append(request)
                continue
            if not self._allocate(seqs):
                return
            self.waiting.popleft()
            self._schedule_tokens(seqs, out, budget)
            budget.seqs -= peak - len(seqs)  # the rows its forks take from the next step on
            self.running.append(request)

    def _fits_apart(self, seqs: list[Sequence]) -> bool:
        """A recomputed request's forked sequences must fit the empty pool together (with a slot
        for each one's next token), or the request would wait forever. With prefix caching they
        find the prompt's blocks in the cache; without, `_allocate` shares them again, so a
        request `check_request` admitted always fits: this refuses only what it never saw."""
        if len(seqs) < 2 or self.block_manager.enable_prefix_caching:
            return True
        size = self.block_manager.block_size
        need = sum(-(-(len(seq.token_ids) + 1) // size) for seq in seqs)
        need -= self._num_shared_blocks(seqs) * (len(seqs) - 1)
        return need <= self.block_manager.num_blocks - self.block_manager.watermark_blocks

    def _num_shared_blocks(self, seqs: list[Sequence]) -> int:
        """Full prompt blocks a recomputed forked group shares again without prefix caching (the
        prefix cache shares them otherwise); none while prompt logprobs are still to come."""
        if len(seqs) < 2 or self.block_manager.enable_prefix_caching or seqs[0].request.needs_prompt_logprobs:
            return 0
        return min(seq.num_prompt_tokens for seq in seqs) // self.block_manager.block_size

    def _allocate(self, seqs: list[Sequence]) -> bool:
        """Give every sequence of a request its blocks, or none of them."""
        if self._num_shared_blocks(seqs):
            return self._allocate_sharing(seqs)
        done: list[Sequence] = []
        for seq in seqs:
            if not self.block_manager.can_allocate(seq.token_ids, seq.request.prefix_root):
                for seq_done in done:
                    self.block_manager.free(seq_done.seq_id)
                    seq_done.num_computed = 0
                    seq_done.status = SeqStatus.WAITING
                return False
            seq.num_computed = self.block_manager.allocate(seq.seq_id, seq.token_ids, seq.request.prefix_root)
            if seq.request.num_cached_tokens is None:
                seq.request.num_cached_tokens = seq.num_computed
            seq.keep_kv_below = 0
            if seq.request.recomputes_cached_prefix:  # the cached part's rows are needed too:
                seq.keep_kv_below, seq.num_computed = seq.num_computed, 0  # recompute, keep its K/V
            seq.status = SeqStatus.RUNNING
            done.append(seq)
        return True

    def _allocate_sharing(self, seqs: list[Sequence]) -> bool:
        """A forked request recomputed without prefix caching: the first sequence gets its own
        blocks, the others share its full prompt blocks (the same tokens, so the same K/V) and
        run their own tokens only once it has computed those (`_prefix_donor`), as the group did
        before it was preempted: it needs no more blocks than when it was admitted."""
        manager = self.block_manager
        shared = self._num_shared_blocks(seqs)
        need = sum(-(-len(seq.token_ids) // manager.block_size) for seq in seqs) - shared * (len(seqs) - 1)
        if manager.num_free_blocks - need < manager.watermark_blocks:
            return False
        donor = seqs[0]
        manager.allocate(donor.seq_id, donor.token_ids, donor.request.prefix_root)
        for seq in seqs[1:]:
            manager.allocate_sharing(seq.seq_id, seq.token_ids, donor.seq_id, shared)
        for seq in seqs:
            seq.num_computed = 0 if seq is donor else shared * manager.block_size
            seq.keep_kv_below = 0
            seq.status = SeqStatus.RUNNING
        donor.request.prefix_donor, donor.request.num_shared_prefix = donor, shared * manager.block_size
        return True
