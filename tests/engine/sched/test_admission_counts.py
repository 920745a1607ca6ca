"""Admission counts what a request will become: n / best_of / beam width sequences, against
`max_num_seqs`, before it forks. Driven through the real Scheduler and BlockManager, with the
model's part of a step replaced by fixed tokens (the scheduler never sees the model)."""

from __future__ import annotations

import pytest

from common.sampling_params import SamplingParams
from engine.kv.block_manager import BlockManager
from engine.sched.admission import RequestRejected, check_request
from engine.sched.output import StepSamples
from engine.sched.scheduler import Scheduler
from engine.sched.sequence import Request, Sequence

MAX_SEQS = 32


def _request(request_id: str, n: int, prompt_len: int = 8, max_tokens: int = 4) -> Request:
    params = SamplingParams(n=n, temperature=1.0, seed=1, max_tokens=max_tokens, ignore_eos=True)
    request = Request(request_id=request_id, prompt_token_ids=list(range(1, prompt_len + 1)), params=params)
    request.seqs.append(Sequence(request=request, index=0, token_ids=list(request.prompt_token_ids),
                                 num_prompt_tokens=prompt_len))
    return request


def _run(scheduler: Scheduler, requests: list[Request]) -> tuple[list[int], dict[str, int]]:
    """Step until every request finished; rows per step, and the step each request's first token came."""
    for request in requests:
        scheduler.add(request)
    rows: list[int] = []
    first: dict[str, int] = {}
    while scheduler.has_unfinished():
        sched = scheduler.schedule()
        rows.append(sum(1 for item in sched.scheduled))
        live = sum(len(r.unfinished_seqs()) for r in scheduler.running)
        assert live <= MAX_SEQS, f"{live} sequences running against max_num_seqs {MAX_SEQS}"
        done = [item for item in sched.scheduled if item.sample]
        samples = StepSamples(seqs=[item.seq for item in done],
                              token_ids=[[7] * item.seq.request.params.n if item.seq.request.first_token_time is None
                               and item.seq.request.params.n > 1 else [7] for item in done])
        for item in done:
            first.setdefault(item.seq.request.request_id, len(rows))
        scheduler.update_from_output(sched, samples)
    return rows, first


def test_a_burst_of_n16_requests_never_runs_more_sequences_than_allowed() -> None:
    manager = BlockManager(num_blocks=4096, block_size=16)
    scheduler = Scheduler(manager, max_num_seqs=MAX_SEQS, max_num_batched_tokens=1024)
    burst = [_request(f"n16-{i}", n=16) for i in range(8)]
    plain = _request("plain", n=1)
    rows, first = _run(scheduler, [*burst, plain])
    assert max(rows) <= MAX_SEQS
    # two n=16 requests fill the 32 sequences; FCFS: the plain one starts once the burst is served,
    # a bounded number of steps later (4 waves of 2 requests x 4 tokens), not after 8 x 16 forks
    assert first["plain"] <= 4 * 5 + 1
    assert manager.num_used_blocks == 0


def test_before_the_fix_the_burst_would_have_run_128_sequences() -> None:
    """The property the fix guards: unforked, each n=16 request looks like one sequence."""
    requests = [_request(f"r{i}", n=16) for i in range(8)]
    assert sum(len(r.unfinished_seqs()) for r in requests) == 8
    assert sum(r.num_seqs_at_peak for r in requests) == 128


def test_a_request_wider_than_max_num_seqs_is_refused_with_a_clear_error() -> None:
    manager = BlockManager(num_blocks=64, block_size=16)
    with pytest.raises(RequestRejected, match="at most 8") as info:
        check_request([1, 2, 3], SamplingParams(n=16, temperature=1.0), 100, 512, manager, max_num_seqs=8)
    assert info.value.code == "invalid_parameter"
