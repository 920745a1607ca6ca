"""Speculative decoding end to end on tiny models: the same tokens as without it (greedy and
seeded sampling), with prefix hits, chunked prefill and preemption (swap and recompute); every
block back at the end; the policy turns it off for a large batch and ineligible requests; the
sampled distribution is that of plain sampling (chi-square). Each test runs for both methods."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from common.sampling_params import SamplingParams
from engine.llm import LLM
from engine.worker.heartbeat import flatten_stats
from tests.engine.helpers import assert_no_leaks, generated

SPECS: dict[str, dict[str, Any]] = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
    "suffix": {"method": "suffix", "num_speculative_tokens": 4, "suffix_decoding_max_tree_depth": 12},
}
PROMPTS = [[5, 6, 7, 8, 9] * 6, list(range(40, 75)), [100, 101] * 9 + list(range(200, 210)), [33] * 20]
GREEDY = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)


def _llm(model: Path, spec: dict[str, Any] | None, **config: Any) -> LLM:
    return LLM(str(model), kv_cache_memory=config.pop("kv_cache_memory", 8 << 20), speculative_config=spec,
               **config)


@pytest.fixture(params=sorted(SPECS))
def spec(request: pytest.FixtureRequest) -> dict[str, Any]:
    return SPECS[request.param]


@pytest.fixture(scope="module")
def reference(looping_llama_dir: Path) -> list[list[int]]:
    return generated(_llm(looping_llama_dir, None).generate(PROMPTS, GREEDY))


def test_greedy_identical_and_proposals_accepted(looping_llama_dir: Path, reference: list[list[int]],
                                                 spec: dict[str, Any]) -> None:
    llm = _llm(looping_llama_dir, spec)
    assert generated(llm.generate(PROMPTS, GREEDY)) == reference
    spec = llm.engine.stats()["spec"]
    assert spec["accepted_tokens"] > 0 and spec["verified_rows"] > 0
    assert spec["proposed_tokens"] >= spec["accepted_tokens"]
    assert 0 < spec["acceptance_rate"] <= 1 and spec["mean_acceptance_length"] > 1
    lengths = llm.engine.stats()["spec_accepted_lengths"]
    assert any(n not in ("0", "4") for n in lengths)  # partial acceptances happened
    assert flatten_stats(llm.engine.stats())["spec_accepted_tokens"] == spec["accepted_tokens"]  # heartbeat form
    assert_no_leaks(llm)


def test_greedy_identical_with_prefix_hits_and_chunked_prefill(looping_llama_dir: Path, reference: list[list[int]],
                                                               spec: dict[str, Any]) -> None:
    llm = _llm(looping_llama_dir, spec, max_num_batched_tokens=16)
    assert generated(llm.generate(PROMPTS, GREEDY)) == reference
    assert_no_leaks(llm)
    hits = llm.engine.stats()["prefix_hits"]
    assert generated(llm.generate(PROMPTS, GREEDY)) == reference
    assert llm.engine.stats()["prefix_hits"] > hits
    assert llm.engine.stats()["spec"]["accepted_tokens"] > 0
    assert_no_leaks(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_identical_under_preemption(looping_llama_dir: Path, reference: list[list[int]], mode: str,
                                           spec: dict[str, Any]) -> None:
    # 12 blocks of 8 tokens for four sequences growing to 66-84 tokens: they preempt each other
    llm = _llm(looping_llama_dir, spec, num_gpu_blocks=12, block_size=8, preemption_mode=mode, watermark=0.0,
               num_cpu_blocks=64, debug_blocks=True)  # invariants checked after every step
    assert generated(llm.generate(PROMPTS, GREEDY)) == reference
    stats = llm.engine.stats()
    assert stats["preemptions"].get(mode, 0) > 0
    assert stats["spec"]["accepted_tokens"] > 0
    assert_no_leaks(llm)


@pytest.fixture(scope="module")
def cycle_prompt(markov_llama_dir: Path) -> list[int]:
    """Two turns of the model's greedy cycle."""
    out = generated(_llm(markov_llama_dir, None).generate([[7, 8, 9, 10]], GREEDY))[0]
    return out[24:48] * 2


@pytest.fixture(scope="module")
def seeded_plain(markov_llama_dir: Path, cycle_prompt: list[int]) -> tuple[list[list[int]], list[SamplingParams],
                                                                           list[list[int]]]:
    """Prompts, seeded sampling parameters and the tokens plain decoding gives for them."""
    prompts = [cycle_prompt, *PROMPTS]
    params = [SamplingParams(temperature=0.5 if s % 2 else 1.0, seed=s, max_tokens=48, ignore_eos=True,
                             top_p=0.9 if s % 2 else 1.0) for s in range(len(prompts) * 2)]
    prompts = prompts[:1] * len(prompts) + prompts
    return prompts, params, generated(_llm(markov_llama_dir, None).generate(prompts, params))


def test_seeded_sampling_gives_the_same_tokens(markov_llama_dir: Path, spec: dict[str, Any],
                                               seeded_plain: tuple[list[list[int]], list[SamplingParams],
                                                                   list[list[int]]]) -> None:
    prompts, params, plain = seeded_plain
    llm = _llm(markov_llama_dir, {**spec, "disable_by_batch_size": 16})
    assert generated(llm.generate(prompts, params)) == plain
    assert llm.engine.stats()["spec"]["accepted_tokens"] > 0, llm.engine.stats()["spec"]
    assert_no_leaks(llm)


def test_off_for_large_batches_and_ineligible_requests(looping_llama_dir: Path, reference: list[list[int]],
                                                       spec: dict[str, Any]) -> None:
    llm = _llm(looping_llama_dir, {**spec, "disable_by_batch_size": 3})
    assert generated(llm.generate(PROMPTS, GREEDY)) == reference  # four sequences: never proposes
    assert llm.engine.stats()["spec"]["proposed_tokens"] == 0
    beams = SamplingParams(n=2, temperature=0.0, max_tokens=16, ignore_eos=True, use_beam_search=True)
    llm.generate(PROMPTS[:1], beams)
    assert llm.engine.stats()["spec"]["proposed_tokens"] == 0
    assert_no_leaks(llm)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_of_accepted_tokens_equal_plain_decoding(markov_llama_dir: Path, cycle_prompt: list[int],
                                                          spec: dict[str, Any], temperature: float) -> None:
    """A request asking for logprobs speculates: its tokens, each token's logprob and its top
    alternatives are plain decoding's (the positions' logits come from a 1 + k row, whose linear
    layers may round differently from one row's: the logprobs agree to float rounding)."""
    prompts = [cycle_prompt] * 3 + PROMPTS[:2]
    params = [SamplingParams(temperature=temperature, seed=s, max_tokens=40, ignore_eos=True, logprobs=3)
              for s in range(len(prompts))]
    plain = _llm(markov_llama_dir, None).generate(prompts, params)
    llm = _llm(markov_llama_dir, {**spec, "disable_by_batch_size": 16})
    fast = llm.generate(prompts, params)
    assert llm.engine.stats()["spec"]["accepted_tokens"] > 0, llm.engine.stats()["spec"]
    for ours, theirs in zip(fast, plain, strict=True):
        a, b = ours.outputs[0], theirs.outputs[0]
        assert a.token_ids == b.token_ids
        assert a.logprobs is not None and b.logprobs is not None and len(a.logprobs) == len(b.logprobs) == 40
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert x["token_id"] == y["token_id"]
            assert x["logprob"] == pytest.approx(y["logprob"], abs=2e-3)
            assert [v for _, v in x["top_logprobs"]] == pytest.approx([v for _, v in y["top_logprobs"]], abs=2e-3)
        assert a.cumulative_logprob == pytest.approx(b.cumulative_logprob, abs=2e-2)
    assert_no_leaks(llm)


PROCESSED = [
    {"repetition_penalty": 1.3}, {"presence_penalty": 0.8}, {"frequency_penalty": 0.6},
    {"logit_bias": {11: 2.0, 12: -1.5}}, {"min_tokens": 30, "ignore_eos": False, "stop_token_ids": [9, 10]},
]


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_penalties_bias_and_min_tokens_give_plain_decodings_tokens(markov_llama_dir: Path, cycle_prompt: list[int],
                                                                   spec: dict[str, Any], temperature: float) -> None:
    """Processors run on each position's logits as if the proposals before it had been sampled:
    the tokens are plain decoding's, greedy and seeded, and proposals are still accepted."""
    prompts = [cycle_prompt] * len(PROCESSED)
    params = [SamplingParams(**({"temperature": temperature, "seed": i, "max_tokens": 40, "ignore_eos": True} | extra))
              for i, extra in enumerate(PROCESSED)]
    plain = generated(_llm(markov_llama_dir, None).generate(prompts, params))
    llm = _llm(markov_llama_dir, {**spec, "disable_by_batch_size": 16})
    assert generated(llm.generate(prompts, params)) == plain
    assert llm.engine.stats()["spec"]["accepted_tokens"] > 0, llm.engine.stats()["spec"]
    assert_no_leaks(llm)


@pytest.mark.parametrize("extra", [{}, {"logprobs": 2}, {"top_k": 20, "min_p": 0.02}])
def test_typical_p_gives_plain_decodings_tokens(markov_llama_dir: Path, cycle_prompt: list[int],
                                                spec: dict[str, Any], extra: dict[str, Any]) -> None:
    """typical_p is verified as it is sampled: on the plan's verifier picker (`StepPlan.spec_picker`) and, with
    logprobs, from the positions' logits (`draw_from_logits`); the seeded tokens are plain
    decoding's, and the filter changes them."""
    prompts = [cycle_prompt] * 3 + PROMPTS[:2]
    params = [SamplingParams(**({"temperature": 1.0, "seed": s, "typical_p": 0.2 + 0.15 * s, "max_tokens": 40,
                                 "ignore_eos": True} | extra)) for s in range(len(prompts))]
    plain = generated(_llm(markov_llama_dir, None).generate(prompts, params))
    llm = _llm(markov_llama_dir, {**spec, "disable_by_batch_size": 16})
    assert generated(llm.generate(prompts, params)) == plain
    assert llm.engine.stats()["spec"]["accepted_tokens"] > 0, llm.engine.stats()["spec"]
    untyped = [SamplingParams(**{**p.to_dict(), "typical_p": 1.0}) for p in params]
    assert generated(llm.generate(prompts, untyped)) != plain
    assert_no_leaks(llm)


def test_parallel_samples_and_best_of_give_plain_decodings_outputs(markov_llama_dir: Path, cycle_prompt: list[int],
                                                                  spec: dict[str, Any]) -> None:
    """n > 1 and best_of: each forked candidate speculates on its own stream; every candidate's
    tokens, and best_of's choice (by cumulative logprob), are plain decoding's."""
    params = [SamplingParams(n=3, temperature=0.8, seed=4, max_tokens=32, ignore_eos=True),
              SamplingParams(n=1, best_of=3, temperature=1.0, seed=5, max_tokens=32, ignore_eos=True),
              SamplingParams(n=2, temperature=0.0, max_tokens=32, ignore_eos=True)]
    prompts = [cycle_prompt] * len(params)

    def outputs(llm: LLM) -> list[list[tuple[list[int], float]]]:
        return [[(c.token_ids, c.cumulative_logprob) for c in o.outputs] for o in llm.generate(prompts, params)]

    plain = outputs(_llm(markov_llama_dir, None))
    llm = _llm(markov_llama_dir, {**spec, "disable_by_batch_size": 16})
    ours = outputs(llm)
    assert [[tokens for tokens, _ in o] for o in ours] == [[tokens for tokens, _ in o] for o in plain]
    for o, p in zip(ours, plain, strict=True):  # logprobs of a 1 + k row: float rounding apart
        assert [c for _, c in o] == pytest.approx([c for _, c in p], abs=2e-2)
    assert llm.engine.stats()["spec"]["accepted_tokens"] > 0, llm.engine.stats()["spec"]
    assert_no_leaks(llm)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_resumed_request_speculates_and_continues_the_same_tokens(markov_llama_dir: Path, cycle_prompt: list[int],
                                                                    spec: dict[str, Any], temperature: float) -> None:
    """Failover resume: a request handed the tokens its client already got continues, speculating,
    with the tokens plain decoding gives after them (seeded draws keyed by output-token index)."""
    params = SamplingParams(temperature=temperature, seed=9, max_tokens=40, ignore_eos=True)
    full = generated(_llm(markov_llama_dir, None).generate([cycle_prompt], params))[0]
    engine = _llm(markov_llama_dir, spec).engine
    engine.add_request("resumed", cycle_prompt, params, generated=full[:11])
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.outputs[0].token_ids
    assert tokens == full[11:]
    assert engine.stats()["spec"]["accepted_tokens"] > 0, engine.stats()["spec"]
    assert engine.block_manager.num_used_blocks == 0


REPEAT = {"kind": "regex", "spec": "(one two three ){12}"}


def test_structured_output_gives_plain_decodings_tokens(tiny_llama_dir: Path, spec: dict[str, Any]) -> None:
    """A grammar: each position is masked by the grammar advanced over the proposals before it (a
    copy; the sequence's own state moves only with kept tokens). A repeating pattern is proposed
    and accepted; a JSON schema over seeds gives the same answers with and without speculation."""
    from tests.engine.test_engine_structured import JSON_SCHEMA

    prompts = [list(range(60, 80))] * 4
    params = [SamplingParams(temperature=t, seed=s, max_tokens=80, structured_output=REPEAT)
              for s, t in enumerate((0.0, 1.0))]
    params += [SamplingParams(temperature=1.0, seed=s, max_tokens=80, structured_output=JSON_SCHEMA) for s in (2, 3)]
    plain = generated(_llm(tiny_llama_dir, None).generate(prompts, params))
    llm = _llm(tiny_llama_dir, {**spec, "disable_by_batch_size": 16})
    assert generated(llm.generate(prompts, params)) == plain
    assert llm.engine.stats()["spec"]["accepted_tokens"] > 0, llm.engine.stats()["spec"]
    assert_no_leaks(llm)


def _sampled_counts(model: Path, prompt: list[int], config: dict[str, Any] | None,
                    seeds: range) -> Counter[tuple[int, int]]:
    """(position, token) counts of the 2nd-4th sampled tokens, one request per seed."""
    llm = _llm(model, config, max_num_seqs=16)
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=4, ignore_eos=True) for s in seeds]
    outs = generated(llm.generate([prompt] * len(params), params))
    if config is not None:
        stats = llm.engine.stats()["spec"]
        assert 0 < stats["accepted_tokens"] < stats["proposed_tokens"]
    assert_no_leaks(llm)
    return Counter((j, t) for out in outs for j, t in enumerate(out) if j >= 1)


@pytest.fixture(scope="module")
def plain_counts(markov_llama_dir: Path, cycle_prompt: list[int]) -> Counter[tuple[int, int]]:
    return _sampled_counts(markov_llama_dir, cycle_prompt, None, range(240))


def test_sampled_distribution_matches_plain_sampling(markov_llama_dir: Path, spec: dict[str, Any],
                                                     cycle_prompt: list[int],
                                                     plain_counts: Counter[tuple[int, int]]) -> None:
    """Chi-square of the 2nd-4th tokens' values, 240 seeds each way (disjoint seeds, so the runs are
    independent samples); acceptances and rejections must have happened at those positions."""
    plain = plain_counts
    spec_counts = _sampled_counts(markov_llama_dir, cycle_prompt, {**spec, "disable_by_batch_size": 1000},
                                  range(1000, 1240))
    keys = set(plain) | set(spec_counts)
    # pool rare cells per position so every cell expects >= 5 in each run
    stat, cells = 0.0, 0
    for position in (1, 2, 3):
        pos_keys = sorted(k for k in keys if k[0] == position)
        big = [k for k in pos_keys if plain[k] + spec_counts[k] >= 20]
        rest = [k for k in pos_keys if k not in big]
        groups = [[k] for k in big] + ([rest] if rest else [])
        for group in groups:
            a = sum(plain[k] for k in group)
            b = sum(spec_counts[k] for k in group)
            expected = (a + b) / 2
            stat += (a - expected) ** 2 / expected + (b - expected) ** 2 / expected
            cells += 1
    dof = cells - 3
    # the 99.9% quantile of chi-square is below dof + 3.1 * sqrt(2 dof) + 10 for these sizes
    assert stat < dof + 3.1 * (2 * dof) ** 0.5 + 10, (stat, dof)
