"""Replay a request trace through KV-memory policies at one memory budget, step by step.

Each step: requests that have arrived join the waiting queue; waiting requests are admitted
first-come first-served while the policy finds them memory (the first that does not fit stops
admission); every running sequence then grows by one token, oldest request first. When a
sequence cannot grow, the newest running request is preempted by recompute (its memory freed,
it returns to the head of the queue and later re-allocates its prompt and generated tokens).
A request longer than `max_model_len`, or one that cannot run even alone, is rejected.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from pagedserve.sim.contiguous import ContiguousPolicy
from pagedserve.sim.metrics import PolicyResult, StepRecorder
from pagedserve.sim.paged import PagedPolicy
from pagedserve.sim.traces import Request
from pagedserve.sim.types import Group, Policy

BLOCK_SIZES = (8, 16, 32, 64, 128)


@dataclass(frozen=True, slots=True)
class SimConfig:
    """The budget and clock shared by every policy of a run."""

    capacity_tokens: int = 65536
    max_model_len: int = 2048
    step_time: float = 0.025  # seconds per decoding step, to place arrivals on the step clock
    max_num_seqs: int = 0  # 0: no cap besides memory
    beam_keep: float = 0.5
    seed: int = 0

    def __post_init__(self) -> None:
        if self.capacity_tokens < 1 or self.max_model_len < 1 or self.step_time <= 0 or self.max_num_seqs < 0:
            raise ValueError("capacity, max_model_len and step_time must be positive, max_num_seqs >= 0")


def make_policies(config: SimConfig, block_sizes: Iterable[int] = BLOCK_SIZES, *, both_sharing: bool = False
                  ) -> list[Policy]:
    """Contiguous max, contiguous oracle, then paged per block size (with sharing, and without
    it too when `both_sharing`)."""
    policies: list[Policy] = [
        ContiguousPolicy(config.capacity_tokens, config.max_model_len),
        ContiguousPolicy(config.capacity_tokens, config.max_model_len, oracle=True),
    ]
    for block_size in block_sizes:
        for sharing in (True, False) if both_sharing else (True,):
            policies.append(PagedPolicy(config.capacity_tokens, block_size, sharing=sharing,
                                        beam_keep=config.beam_keep, seed=config.seed))
    return policies


def simulate(policy: Policy, trace: list[Request], config: SimConfig,
             on_step: Callable[[int], None] | None = None) -> PolicyResult:
    """Run the whole trace through one policy; `on_step(finished)` is called after every step."""
    result = PolicyResult(policy.name, policy.kind, policy.block_size, policy.sharing, config.capacity_tokens)
    recorder = StepRecorder(config.capacity_tokens)
    pending = deque(sorted(trace, key=lambda r: r.arrival))
    waiting: deque[Group] = deque()
    running: list[Group] = []
    step = 0
    while pending or waiting or running:
        if not waiting and not running:
            step = max(step, _arrival_step(pending[0], config))
        while pending and _arrival_step(pending[0], config) <= step:
            request = pending.popleft()
            if request.total_len > config.max_model_len:
                result.rejected += 1
            else:
                waiting.append(Group(request))
        _admit(policy, waiting, running, result, config.max_num_seqs)
        _decode(policy, waiting, running, result)
        head = waiting[0] if waiting else None
        recorder.record(step, sum(g.request.width for g in running), policy.memory(head))
        for group in [g for g in running if g.done]:  # freed after the step that wrote their last token
            running.remove(group)
            policy.release(group)
            result.finished += 1
        if on_step is not None:
            on_step(result.finished + result.rejected)
        step += 1
    result.steps = step
    result.cow_copies = policy.cow_copies
    result.prefix_hit_tokens = policy.prefix_hit_tokens
    result.blocked_by_fragmentation = policy.fragmentation_blocks
    recorder.fill(result)
    return result


def _arrival_step(request: Request, config: SimConfig) -> int:
    return math.ceil(request.arrival / config.step_time - 1e-9)


def _admit(policy: Policy, waiting: deque[Group], running: list[Group], result: PolicyResult,
           max_num_seqs: int) -> None:
    num_seqs = sum(g.request.width for g in running)
    while waiting:
        group = waiting[0]
        if max_num_seqs and running and num_seqs + group.request.width > max_num_seqs:
            return
        if policy.try_admit(group):
            running.append(waiting.popleft())
            num_seqs += group.request.width
        elif running:
            return
        else:  # not even an empty pool holds it
            waiting.popleft()
            result.rejected += 1


def _decode(policy: Policy, waiting: deque[Group], running: list[Group], result: PolicyResult) -> None:
    i = 0
    while i < len(running):
        group = running[i]

        def make_room(current: int = i) -> bool:
            if len(running) - 1 <= current:
                return False
            _preempt(policy, running.pop(), waiting, result)
            return True

        if not policy.step(group, make_room):
            running.pop(i)
            if not running and i == 0:  # alone and still too big: it can never finish
                policy.release(group)
                result.rejected += 1
            else:
                _preempt(policy, group, waiting, result)
            continue
        group.generated += 1
        i += 1


def _preempt(policy: Policy, group: Group, waiting: deque[Group], result: PolicyResult) -> None:
    policy.release(group)
    group.preemptions += 1
    result.preemptions += 1
    waiting.appendleft(group)
