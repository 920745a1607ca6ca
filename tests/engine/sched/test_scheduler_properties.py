"""The scheduler and block manager alone, driven by hypothesis over random arrivals, prompt and
output lengths, pool sizes, token budgets, n, aborts and both preemption modes.

The model's part of a step is a pure function of each sequence's own history (`_next_tokens`), so
a request's tokens must not depend on the schedule: every run is compared with one in a pool and
budget roomy enough that nothing is preempted or chunked. After every step: never more rows than
`max_num_seqs` nor tokens than `max_num_batched_tokens`, the pool's bookkeeping consistent
(`check_invariants`) and holding exactly the sequences of running and swapped requests; requests
are first scheduled in arrival order (FCFS); every request ends within a step bound, and at the
end every GPU and CPU block is free."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.sampling_params import SamplingParams
from engine.kv.block_manager import BlockManager
from engine.sched.admission import RequestRejected, check_request
from engine.sched.output import StepSamples
from engine.sched.scheduler import Scheduler
from engine.sched.sequence import Request, Sequence

VOCAB = 97


@dataclass(frozen=True)
class Arrival:
    step: int  # the step before which the request is added
    prompt: tuple[int, ...]
    max_tokens: int
    n: int
    abort_after: int | None  # steps after arrival at which it is aborted (None: never)


@dataclass(frozen=True)
class Case:
    arrivals: tuple[Arrival, ...]
    num_blocks: int
    num_cpu_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    preemption_mode: str
    prefix_caching: bool


@st.composite
def cases(draw: st.DrawFn) -> Case:
    shared = draw(st.lists(st.integers(1, VOCAB - 1), min_size=0, max_size=24))  # a common prefix some prompts take
    arrivals = []
    for _ in range(draw(st.integers(1, 10))):
        own = draw(st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=40))
        prompt = (shared + own) if draw(st.booleans()) else own
        arrivals.append(Arrival(draw(st.integers(0, 12)), tuple(prompt), draw(st.integers(1, 12)),
                                draw(st.sampled_from([1, 1, 2, 3])),
                                draw(st.none() | st.integers(0, 20))))
    arrivals.sort(key=lambda a: a.step)
    mode = draw(st.sampled_from(["recompute", "swap", "auto"]))
    return Case(tuple(arrivals), num_blocks=draw(st.integers(4, 40)),
                num_cpu_blocks=draw(st.integers(0, 40)) if mode != "recompute" else 0,
                block_size=draw(st.sampled_from([2, 4, 8, 16])), max_num_seqs=draw(st.integers(1, 8)),
                max_num_batched_tokens=draw(st.integers(8, 96)), preemption_mode=mode,
                prefix_caching=draw(st.booleans()))


def _next_tokens(seq: Sequence, fork: int) -> list[int]:
    """The 'model': the next token from the sequence's whole history only; `fork` candidates at a
    request's first token when n > 1."""
    base = sum((i + 1) * t for i, t in enumerate(seq.token_ids)) % VOCAB
    return [(base + k * 7) % VOCAB + 1 for k in range(fork)]


def _request(i: int, arrival: Arrival) -> Request:
    params = SamplingParams(n=arrival.n, temperature=1.0 if arrival.n > 1 else 0.0, seed=1,
                            max_tokens=arrival.max_tokens, ignore_eos=True)
    request = Request(request_id=f"r{i}", prompt_token_ids=list(arrival.prompt), params=params)
    request.seqs.append(Sequence(request=request, index=0, token_ids=list(request.prompt_token_ids),
                                 num_prompt_tokens=len(arrival.prompt)))
    return request


@dataclass
class Outcome:
    outputs: dict[str, list[tuple[int, ...]]]  # finished requests: each sequence's output tokens
    rejected: set[str]  # refused by the scheduler (the prompt never fits)
    refused: set[str]  # refused at admission, before queueing
    aborted: set[str]
    first_scheduled: dict[str, int]
    preemptions: int = 0


def _run(case: Case, roomy: bool = False) -> Outcome:
    if roomy:
        manager = BlockManager(4096, case.block_size, enable_prefix_caching=case.prefix_caching)
        scheduler = Scheduler(manager, max_num_seqs=256, max_num_batched_tokens=1 << 16)
    else:
        manager = BlockManager(case.num_blocks, case.block_size, case.num_cpu_blocks,
                               enable_prefix_caching=case.prefix_caching)
        scheduler = Scheduler(manager, max_num_seqs=case.max_num_seqs,
                              max_num_batched_tokens=case.max_num_batched_tokens,
                              preemption_mode=case.preemption_mode)
    requests = [_request(i, a) for i, a in enumerate(case.arrivals)]
    pending = list(zip(case.arrivals, requests, strict=True))
    added: list[tuple[Arrival, Request, int]] = []
    out = Outcome({}, set(), set(), set(), {})
    total = sum((len(a.prompt) + a.max_tokens) * a.n for a in case.arrivals)
    bound = 12 + 4 * total + 8 * len(requests)  # every request ends well within this many steps
    step = 0
    while pending or scheduler.has_unfinished():
        assert step < bound, f"not finished after {step} steps: starvation or a livelock"
        while pending and pending[0][0].step <= step:
            arrival, request = pending.pop(0)
            try:  # what the engine refuses before queueing (n over max_num_seqs, never fits the pool)
                check_request(request.prompt_token_ids, request.params, VOCAB + 1, 1 << 30, manager,
                              scheduler.max_num_seqs)
            except RequestRejected:
                out.refused.add(request.request_id)
                continue
            scheduler.add(request)
            added.append((arrival, request, step))
        if not roomy:
            for arrival, request, at in added:
                if (arrival.abort_after is not None and step - at == arrival.abort_after
                        and request.request_id not in out.outputs and request.request_id not in out.rejected):
                    scheduler.abort(request)
                    out.aborted.add(request.request_id)
        sched = scheduler.schedule()
        rows = len(sched.scheduled)
        assert rows <= scheduler.max_num_seqs
        assert sum(item.num_new for item in sched.scheduled) <= scheduler.max_num_batched_tokens
        live = sum(len(r.unfinished_seqs()) for r in scheduler.running)
        assert live <= scheduler.max_num_seqs
        if roomy:
            assert not (sched.blocks_to_swap_out or scheduler.num_preemptions), "the roomy run preempted"
        for item in sched.scheduled:
            out.first_scheduled.setdefault(item.seq.request.request_id, step)
        out.rejected |= {r.request_id for r in sched.rejected}
        done = [item for item in sched.scheduled if item.sample]
        samples = StepSamples(seqs=[item.seq for item in done],
                              token_ids=[_next_tokens(item.seq, item.seq.request.params.n
                                            if item.seq.request.first_token_time is None else 1)
                               for item in done])
        scheduler.update_from_output(sched, samples)
        for request in requests:
            if request.is_finished and request.error is None and request.request_id not in out.aborted:
                out.outputs.setdefault(request.request_id, sorted(tuple(s.output_token_ids) for s in request.seqs))
        manager.check_invariants()
        holding = {seq.seq_id for queue in (scheduler.running, scheduler.swapped) for r in queue
                   for seq in r.unfinished_seqs()}
        assert set(manager.seqs) == holding, "the pool holds sequences no running/swapped request owns, or lost one"
        step += 1
    out.preemptions = sum(scheduler.num_preemptions.values())
    assert manager.num_used_blocks == 0 and manager.num_free_cpu_blocks == case.num_cpu_blocks * (not roomy)
    # FCFS: among requests that were scheduled, the first schedule follows arrival order
    order = [out.first_scheduled[r.request_id] for _, r, _ in added if r.request_id in out.first_scheduled
             and r.request_id not in out.aborted]
    assert order == sorted(order), f"first scheduled out of arrival order: {order}"
    return out


# derandomize: CI runs the same 150 cases every time (a fresh clone must pass every time); wider
# runs (`max_examples`, `--hypothesis-seed`) are how the gaps of issue 43 below were found.
@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_the_schedule_never_changes_a_requests_tokens_and_keeps_every_bound(case: Case) -> None:
    tight, roomy = _run(case), _run(case, roomy=True)
    for i, arrival in enumerate(case.arrivals):
        rid = f"r{i}"
        if rid in tight.aborted or rid in tight.refused:
            continue
        # what can never fit is refused at admission (`check_request`): an admitted request finishes
        # (a forked one recomputed without prefix caching once was refused here: issue 43)
        assert rid not in tight.rejected, rid
        assert tight.outputs[rid] == roomy.outputs[rid], f"{rid}: tokens depend on the schedule"
        assert all(len(tokens) == arrival.max_tokens for tokens in tight.outputs[rid])
        assert len(tight.outputs[rid]) == arrival.n


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_tight_pool_preempts_and_still_gives_the_roomy_runs_tokens(mode: str) -> None:
    """The oracle above is only meaningful if the two schedules differ: here the tight pool
    preempts (and chunks), the roomy one does not, and the tokens are the same."""
    case = Case(tuple(Arrival(0, tuple(range(1 + i, 10 + i)), 12, 1 + i % 2, None) for i in range(4)),
                num_blocks=10, num_cpu_blocks=16 if mode == "swap" else 0, block_size=4, max_num_seqs=4,
                max_num_batched_tokens=8, preemption_mode=mode, prefix_caching=False)
    tight, roomy = _run(case), _run(case, roomy=True)
    assert tight.preemptions > 0 and roomy.preemptions == 0
    assert tight.outputs == roomy.outputs and len(tight.outputs) == 4


def test_a_forked_request_swapped_with_too_little_cpu_room_finishes() -> None:
    """Found by the property suite (issue 43). After its first token r8's two samples (17-token
    prompt, block size 8) share all 3 blocks, the last one partial, with 1 block free. Counting a
    copy-on-write copy for each sample (2 > 1 free) preempted r8 by swap although its first
    append leaves the second sample the block's only holder (1 block); swapped out, it asked
    3 blocks + 1 per sample = 5 of a 4-block pool to come back, so it stayed swapped forever,
    with r9 waiting behind it. Now it is not preempted at all."""
    arrivals = (*(Arrival(0, (1,), 1, 1, None) for _ in range(8)),
                Arrival(0, (1,) * 17, 2, 2, None), Arrival(0, (1,), 1, 1, None))
    case = Case(arrivals, num_blocks=4, num_cpu_blocks=3, block_size=8, max_num_seqs=2, max_num_batched_tokens=8,
                preemption_mode="swap", prefix_caching=False)
    tight = _run(case)
    assert tight.outputs == _run(case, roomy=True).outputs and len(tight.outputs) == 10
    assert tight.preemptions == 0


def test_a_forked_request_swapped_out_of_a_pool_it_filled_comes_back() -> None:
    """The swap-in half of issue 43, with a real preemption. r0 (1 block) and r1 (n = 2, a
    17-token prompt in 3 blocks of 8) fill the 4-block pool; at r1's first token its samples
    need a copy of their shared last block, none is free, and r1 is swapped out (3 host
    blocks). When r0 has finished the pool is empty; r1 needs 3 blocks plus 1 copy = 4 to
    run its next token, but swap-in asked 3 + 1 per sample = 5: r1 stayed swapped, r2 waited
    behind it, and every later step scheduled nothing. Now r1 comes back into the empty pool."""
    arrivals = (Arrival(0, (2,), 8, 1, None), Arrival(0, (1,) * 17, 2, 2, None), Arrival(0, (3,), 1, 1, None))
    case = Case(arrivals, num_blocks=4, num_cpu_blocks=3, block_size=8, max_num_seqs=3, max_num_batched_tokens=8,
                preemption_mode="swap", prefix_caching=False)
    manager = BlockManager(case.num_blocks, case.block_size, case.num_cpu_blocks)
    scheduler = Scheduler(manager, max_num_seqs=3, max_num_batched_tokens=8, preemption_mode="swap")
    requests = [_request(i, a) for i, a in enumerate(arrivals)]
    for request in requests:
        scheduler.add(request)
    trace = []
    for _ in range(40):
        if not scheduler.has_unfinished():
            break
        sched = scheduler.schedule()
        trace.append(([r.request_id for r in scheduler.running], [r.request_id for r in scheduler.swapped],
                      [item.seq.request.request_id for item in sched.scheduled], len(sched.blocks_to_swap_out),
                      len(sched.blocks_to_swap_in)))
        done = [item.seq for item in sched.scheduled if item.sample]
        scheduler.update_from_output(sched, StepSamples(seqs=done, token_ids=[
            _next_tokens(seq, seq.request.params.n if seq.request.first_token_time is None else 1) for seq in done]))
        manager.check_invariants()
    # step 3: r1 swapped out (3 blocks) while r0 decodes; steps 4-7: r0 alone, r1 swapped;
    # step 8: r1 swapped back in (3 blocks) and both samples run; step 9: r2
    assert trace[3] == (["r0"], ["r1"], ["r0"], 3, 0)
    assert all(step[:2] == (["r0"], ["r1"]) for step in trace[4:8])
    assert trace[8] == (["r1"], [], ["r1", "r1"], 0, 3)
    assert trace[9][2] == ["r2"] and not scheduler.has_unfinished()
    assert manager.num_used_blocks == 0 and manager.num_free_cpu_blocks == 3
    assert _run(case).outputs == _run(case, roomy=True).outputs


def test_a_forked_request_recomputed_without_prefix_caching_shares_its_prompt_again() -> None:
    """Found by a wider run of the property suite (issue 43). r1's two samples (a 9-token prompt,
    blocks of 2) share 4 full prompt blocks; preempted by recompute at 11 tokens each, apart they
    needed 6 + 6 = 12 blocks of 9 (a slot for each one's next token included), and r1 was refused
    mid-stream. Now they need 12 - 4 = 8: the second shares the first's prompt blocks again and
    runs once those are computed."""
    arrivals = (Arrival(0, (1,), 4, 1, None), Arrival(0, (1,) * 9, 3, 2, None),
                Arrival(0, (1,), 1, 1, None), Arrival(0, (1,), 1, 1, None))
    case = Case(arrivals, num_blocks=9, num_cpu_blocks=0, block_size=2, max_num_seqs=3, max_num_batched_tokens=8,
                preemption_mode="recompute", prefix_caching=False)
    tight = _run(case)
    assert tight.preemptions > 0 and not tight.rejected
    assert tight.outputs == _run(case, roomy=True).outputs and len(tight.outputs) == 4
