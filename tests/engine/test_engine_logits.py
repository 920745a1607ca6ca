"""Penalties, logit_bias and prompt logprobs through the engine, against Hugging Face: HF's own
repetition penalty, a step-by-step greedy loop with OpenAI's frequency/presence formula on HF
logits, and HF's log-softmax over the prompt (also chunked, and behind a prefix-cache hit)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch

from common.sampling_params import ParamError, SamplingParams
from engine import llm_engine
from engine.llm import LLM
from engine.sample.step_plan import StepPlan, plan_step
from engine.sched.admission import RequestRejected
from tests.engine.helpers import assert_no_leaks

REPETITIVE = [40, 41, 42, 43] * 6  # the same four tokens over and over
NEW = 16


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> LLM:
    return LLM(str(tiny_llama_dir), dtype="float32", kv_cache_memory=8 << 20)


@pytest.fixture(scope="module")
def hf(tiny_llama_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()


def _greedy(llm: LLM, prompt: list[int], **kwargs: Any) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, **kwargs)
    return llm.generate([prompt], params)[0].outputs[0].token_ids


def _openai_penalty_reference(hf: Any, prompt: list[int], frequency: float, presence: float) -> list[int]:
    """Greedy with logits - frequency * count - presence * (count > 0) over the output so far."""
    tokens: list[int] = []
    with torch.inference_mode():
        for _ in range(NEW):
            logits = hf(torch.tensor([prompt + tokens])).logits[0, -1].float()
            counts = torch.bincount(torch.tensor(tokens, dtype=torch.long), minlength=logits.numel()).float()
            logits = logits - frequency * counts - presence * (counts > 0).float()
            tokens.append(int(logits.argmax()))
    return tokens


def test_repetition_penalty_equals_hf_and_changes_output(llm: LLM, hf: Any) -> None:
    plain = _greedy(llm, REPETITIVE)
    penalized = _greedy(llm, REPETITIVE, repetition_penalty=1.8)
    assert penalized != plain
    ids = torch.tensor([REPETITIVE])
    want = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW,
                       min_new_tokens=NEW, repetition_penalty=1.8, pad_token_id=0)[0, len(REPETITIVE):].tolist()
    assert penalized == want
    assert_no_leaks(llm)


@pytest.mark.parametrize(("frequency", "presence"), [(2.0, 0.0), (0.0, 2.0), (0.7, -0.5)])
def test_frequency_and_presence_penalties_follow_openai(llm: LLM, hf: Any, frequency: float,
                                                        presence: float) -> None:
    got = _greedy(llm, REPETITIVE, frequency_penalty=frequency, presence_penalty=presence)
    assert got == _openai_penalty_reference(hf, REPETITIVE, frequency, presence)
    if frequency == 2.0:
        assert got != _greedy(llm, REPETITIVE)
        assert max(got.count(t) for t in set(got)) < max(_greedy(llm, REPETITIVE).count(t) for t in set(got))


def test_logit_bias_bans_and_forces(llm: LLM) -> None:
    plain = _greedy(llm, REPETITIVE)
    banned = _greedy(llm, REPETITIVE, logit_bias={plain[0]: -100.0})
    assert banned[0] != plain[0] and plain[0] not in banned
    forced = _greedy(llm, REPETITIVE, logit_bias={7: 100.0})
    assert forced == [7] * NEW
    # a batch mixing biased and plain rows: each row gets its own bias only
    params = [SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logit_bias={7: 100.0}),
              SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)]
    both = llm.generate([REPETITIVE, REPETITIVE], params)
    assert [o.outputs[0].token_ids for o in both] == [[7] * NEW, plain]
    assert_no_leaks(llm)


def test_seeded_sampling_with_penalties_ignores_the_batch(llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=NEW, ignore_eos=True, frequency_penalty=1.0,
                            repetition_penalty=1.2, logit_bias={5: 3.0})
    alone = llm.generate([REPETITIVE], params)[0].outputs[0].token_ids
    crowd = llm.generate([[9] * 30, REPETITIVE, [11, 12]],
                         [SamplingParams(temperature=0.8, max_tokens=NEW), params, SamplingParams(temperature=0.0)])
    assert crowd[1].outputs[0].token_ids == alone


def _hf_prompt_logprobs(hf: Any, prompt: list[int], k: int) -> tuple[list[float], list[list[int]]]:
    with torch.inference_mode():
        logp = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    chosen = logp[:-1].gather(1, torch.tensor(prompt[1:]).unsqueeze(1)).squeeze(1).tolist()
    return chosen, logp[:-1].topk(k, dim=-1).indices.tolist()


@pytest.mark.parametrize("config", [{}, {"max_num_batched_tokens": 16}], ids=["whole", "chunked"])
def test_prompt_logprobs_equal_hf(tiny_llama_dir: Path, hf: Any, config: dict[str, Any]) -> None:
    llm = LLM(str(tiny_llama_dir), dtype="float32", kv_cache_memory=8 << 20, **config)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, *range(200, 250)]  # 58 tokens: 4 chunks of 16 when chunked
    want, want_top = _hf_prompt_logprobs(hf, prompt, 3)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=3)
    for attempt in range(2):  # the second run finds the prompt's full blocks in the prefix cache
        out = llm.generate([prompt], params)[0]
        entries = out.prompt_logprobs
        assert entries is not None and len(entries) == len(prompt) and entries[0] is None
        assert [e["token_id"] for e in entries[1:] if e] == prompt[1:]
        got = [e["logprob"] for e in entries[1:] if e]
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 2e-3
        assert [[t for t, _ in e["top_logprobs"]] for e in entries[1:] if e] == want_top
        if attempt:
            assert out.num_cached_tokens == 48  # the cached blocks were reused, their logprobs recomputed
    assert_no_leaks(llm)


def test_prompt_logprobs_come_once_on_the_first_delta(llm: LLM) -> None:
    engine = llm.engine
    engine.add_request("pl", [5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True,
                                                           prompt_logprobs=0))
    deltas = []
    while engine.has_unfinished_requests():
        deltas += [o for o in engine.step() if o.request_id == "pl"]
    assert deltas[0].prompt_logprobs is not None and len(deltas[0].prompt_logprobs) == 4
    assert all(d.prompt_logprobs is None for d in deltas[1:])
    assert all(e is None or e["top_logprobs"] == [] for e in deltas[0].prompt_logprobs)


def test_penalties_with_beam_search_are_refused(llm: LLM) -> None:
    """One rule (`SamplingParams.validate`): refused when the parameters are built, and by the
    engine's admission for parameters changed after they were built."""
    with pytest.raises(ParamError, match="do not apply to beam search") as built:
        SamplingParams(n=2, use_beam_search=True, temperature=0.0, max_tokens=4, repetition_penalty=1.2)
    assert built.value.param == "use_beam_search"
    params = SamplingParams(n=2, use_beam_search=True, temperature=0.0, max_tokens=4)
    params.repetition_penalty = 1.2
    with pytest.raises(RequestRejected, match="do not apply to beam search") as refused:
        llm.engine.add_request("beam-pen", REPETITIVE, params)
    assert refused.value.code == "invalid_parameter"
    assert "beam-pen" not in llm.engine.requests


def _picked_steps(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Record, step by step, whether the step's plan gave the runner a token picker (no logits kept)."""
    seen: list[bool] = []
    runner = llm.engine.runner
    execute = runner.execute

    def spy(sched: Any, plan: StepPlan) -> Any:
        seen.append(plan.picker is not None)
        return execute(sched, plan)

    monkeypatch.setattr(runner, "execute", spy)
    return seen


def _assert_same_outcome(first: list[Any], second: list[Any]) -> None:
    """The same tokens (and top-logprob tokens) for every candidate of every request; logprobs
    equal to fp32 rounding (a logits GEMM of other rows rounds differently)."""
    for a, b in zip(first, second, strict=True):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
        for x, y in zip(a.outputs, b.outputs, strict=True):
            assert abs(x.cumulative_logprob - y.cumulative_logprob) < 1e-4
            assert (x.logprobs is None) == (y.logprobs is None)
            for ex, ey in zip(x.logprobs or [], y.logprobs or [], strict=True):
                assert ex["token_id"] == ey["token_id"] and abs(ex["logprob"] - ey["logprob"]) < 1e-4
                assert [t for t, _ in ex["top_logprobs"]] == [t for t, _ in ey["top_logprobs"]]


@pytest.mark.parametrize("kwargs", [
    {"logprobs": 0}, {"logprobs": 3}, {"repetition_penalty": 1.3}, {"logit_bias": {7: 1.0}},
    {"min_tokens": NEW, "stop_token_ids": [5]}, {"n": 2}, {"n": 2, "use_beam_search": True},
    {"temperature": 0.8, "top_p": 0.9, "seed": 3}, {"temperature": 0.8, "top_k": 5, "seed": 4},
    {"temperature": 1.2, "min_p": 0.2, "top_p": 0.95, "top_k": 40, "seed": 5},
])
@pytest.mark.parametrize("plain", [{"temperature": 0.0}, {"temperature": 0.9, "seed": 11}], ids=["greedy", "sampled"])
def test_steps_without_logits_give_the_same_tokens(llm: LLM, monkeypatch: pytest.MonkeyPatch,
                                                   kwargs: dict[str, Any], plain: dict[str, Any]) -> None:
    """Rows that need only a token (greedy, sampled with or without top-k/top-p/min-p) take it
    without the logits matrix; a batch-mate that needs its logits (logprobs, a processor, n > 1,
    beams) gets them alone, and every row's outcome is that of the full-logits path."""
    prompt = list(range(30, 50))
    seen = _picked_steps(llm, monkeypatch)
    alone = llm.generate([prompt], SamplingParams(max_tokens=NEW, ignore_eos=True, **plain))[0].outputs[0].token_ids
    assert seen and all(seen)
    seen.clear()
    params = [SamplingParams(max_tokens=NEW, ignore_eos=True, **plain),
              SamplingParams(**({"temperature": 0.0, "max_tokens": NEW, "ignore_eos": True} | kwargs))]
    prompts = [prompt, list(range(60, 75))]
    outs = llm.generate(prompts, params)
    assert outs[0].outputs[0].token_ids == alone
    assert seen and all(seen)
    monkeypatch.setattr(llm_engine, "plan_step", functools.partial(plan_step, pick_tokens=False))
    seen.clear()
    full = llm.generate(prompts, params)
    assert seen and not any(seen)
    _assert_same_outcome(full, outs)
    assert_no_leaks(llm)
