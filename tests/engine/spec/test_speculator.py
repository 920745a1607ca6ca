"""The speculation policy: batch-size gate, per-sequence acceptance cool-down, and the pause when
speculative steps yield fewer tokens per second than plain ones."""

from __future__ import annotations

from common.sampling_params import SamplingParams
from engine.sched.sequence import Request, Sequence
from engine.spec.config import SpeculativeConfig
from engine.spec.speculator import BASE_COOLDOWN, MIN_SPEC_STEPS, RATE_WINDOW, Speculator, eligible


def _seq(params: SamplingParams | None = None, outputs: int = 1) -> Sequence:
    prompt = [1, 2, 3, 4, 1, 2, 3]
    request = Request(request_id="r", prompt_token_ids=prompt, params=params or SamplingParams(temperature=0.0,
                                                                                               max_tokens=64))
    seq = Sequence(request=request, index=0, token_ids=[*prompt, 4][: len(prompt) + outputs],
                   num_prompt_tokens=len(prompt))
    request.seqs.append(seq)
    return seq


def test_batch_gate_and_proposals() -> None:
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, disable_by_batch_size=2))
    assert spec.allows_batch(2) and not spec.allows_batch(3)
    seq = _seq()
    assert spec.propose(seq, 8) == [1, 2, 3]  # "1 2 3 4" seen before: what followed "4"
    assert spec.propose(seq, 2) == [1, 2]


def test_only_beam_search_never_proposes() -> None:
    for params in (SamplingParams(temperature=0.0, logprobs=2), SamplingParams(temperature=0.0, frequency_penalty=0.5),
                   SamplingParams(temperature=0.0, min_tokens=5), SamplingParams(temperature=0.0, logit_bias={3: 1.0}),
                   SamplingParams(n=2, temperature=1.0), SamplingParams(n=1, best_of=3, temperature=1.0)):
        assert eligible(_seq(params))  # drawn from each position's logits (engine.sample.verify)
    seq = _seq(SamplingParams(n=2, temperature=0.0, use_beam_search=True))
    assert not eligible(seq)
    assert Speculator(SpeculativeConfig(num_speculative_tokens=3)).propose(seq, 8) == []


def test_low_acceptance_cools_a_sequence_down() -> None:
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, min_acceptance_rate=0.5))
    seq = _seq()
    for _ in range(3):
        assert spec.propose(seq, 8)
        spec.record(seq, 3, 0)
    assert all(spec.propose(seq, 8) == [] for _ in range(BASE_COOLDOWN))
    assert spec.propose(seq, 8) == [1, 2, 3]
    assert spec.stats()["proposed_tokens"] == 9 and spec.stats()["accepted_tokens"] == 0
    spec.release(seq)
    assert not spec.states


def test_pauses_when_speculative_steps_are_slower() -> None:
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=3))
    spec.observe_step(0.1, 1, speculative=False)  # 10 tok/s plain
    for _ in range(MIN_SPEC_STEPS):
        spec.observe_step(0.1, 3, speculative=True)  # 30 tok/s: keeps going
    assert spec.allows_batch(1)
    for _ in range(RATE_WINDOW):
        spec.observe_step(1.0, 2, speculative=True)  # 2 tok/s: slower than plain
    assert spec.stats()["pauses"] == 1
    assert not any(spec.allows_batch(1) for _ in range(BASE_COOLDOWN))
    assert spec.allows_batch(1)


def test_a_window_of_mostly_rejected_rows_that_still_pays_does_not_pause() -> None:
    """Speculative steps of 25 ms yielding 5 tokens three times in eight and 1 token otherwise:
    100 tok/s against plain decoding's 71. The median of per-step rates (40 tok/s) paused it."""
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=4))
    for _ in range(RATE_WINDOW):
        spec.observe_step(0.014, 1, speculative=False)
    for i in range(4 * RATE_WINDOW):
        spec.observe_step(0.025, 5 if i % RATE_WINDOW < 3 else 1, speculative=True)
    assert spec.stats()["pauses"] == 0
    for _ in range(RATE_WINDOW):  # every proposal rejected: 40 tok/s, slower than plain
        if not spec.pause:
            spec.observe_step(0.025, 1, speculative=True)
    assert spec.stats()["pauses"] == 1


def test_a_few_slow_steps_do_not_pause_and_a_faster_verdict_resets_the_escalation() -> None:
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=3))
    for _ in range(RATE_WINDOW):
        spec.observe_step(0.1, 1, speculative=False)  # 10 tok/s plain
    for i in range(4 * RATE_WINDOW):  # 30 tok/s, but 3 steps in 8 slowed to 2 tok/s by other work
        spec.observe_step(1.5 if i % RATE_WINDOW < 3 else 0.1, 3, speculative=True)
    assert spec.stats()["pauses"] == 0
    for _ in range(RATE_WINDOW):  # a slow stretch: one pause of BASE_COOLDOWN
        if not spec.pause:
            spec.observe_step(1.0, 2, speculative=True)
    assert spec.stats()["pauses"] == 1 and spec.pause == BASE_COOLDOWN
    while spec.pause:
        spec.allows_batch(1)
    for _ in range(RATE_WINDOW):  # faster again: the next slow verdict starts from BASE_COOLDOWN
        spec.observe_step(0.1, 3, speculative=True)
    for _ in range(RATE_WINDOW):
        if not spec.pause:
            spec.observe_step(1.0, 2, speculative=True)
    assert spec.stats()["pauses"] == 2 and spec.pause == BASE_COOLDOWN  # not 2 x BASE_COOLDOWN


def test_prometheus_counters_and_heartbeat_fields() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from engine.worker.heartbeat import flatten_stats
    from engine.worker.metrics import EngineMetrics

    spec = Speculator(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1))
    seq = _seq()
    spec.propose(seq, 8)
    spec.record(seq, 3, 2)
    stats = {"num_blocks": 1, "num_free_blocks": 1, "usage_ratio": 0.0, "block_utilization": 0.0, "running": 1,
             "waiting": 0, "swapped": 0, "spec": spec.stats(), "spec_accepted_lengths": spec.accepted_lengths(),
             "spec_method": "ngram"}
    metrics = EngineMetrics("cpu")
    metrics.update(stats)
    samples = [s for family in text_string_to_metric_families(metrics.render().decode()) for s in family.samples]
    values = {s.name: s.value for s in samples}
    assert {s.labels["method"] for s in samples if s.name.startswith("pagedserve_spec_")} == {"ngram"}
    assert values["pagedserve_spec_proposed_tokens_total"] == 3
    assert values["pagedserve_spec_accepted_tokens_total"] == 2
    assert values["pagedserve_spec_verified_rows_total"] == 1
    flat = flatten_stats(stats)
    assert flat["spec_mean_acceptance_length"] == 3.0 and flat["spec_accepted_lengths_2"] == 1.0
