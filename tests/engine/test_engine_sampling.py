"""Engine behaviour beyond greedy: parallel sampling shares blocks copy-on-write, seeded
sampling reproduces, beam search equals Hugging Face, best_of, logprobs, stops, aborts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.sampling_params import SamplingParams
from engine.llm import LLM
from tests.engine.helpers import assert_no_leaks

PROMPT = list(range(10, 30))  # 20 tokens: one full block of 16 and a partial one


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> LLM:
    return LLM(str(tiny_llama_dir), dtype="float32", kv_cache_memory=8 << 20)


def _peak_blocks(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> int:
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"peak-{i}", prompt, params)
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, engine.block_manager.num_used_blocks)
    return peak


def test_parallel_sampling_shares_prompt_blocks(tiny_llama_dir: Path) -> None:
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    shared = LLM(str(tiny_llama_dir), dtype="float32", kv_cache_memory=8 << 20, enable_prefix_caching=False)
    peak_shared = _peak_blocks(shared, [PROMPT], params)
    stats = shared.stats()
    # The partial last prompt block is copied once per extra sample that writes into it.
    assert stats["cow_copies"] == 3
    assert_no_leaks(shared)
    separate = LLM(str(tiny_llama_dir), dtype="float32", kv_cache_memory=8 << 20, enable_prefix_caching=False)
    single = SamplingParams(temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    peak_separate = _peak_blocks(separate, [PROMPT] * 4, single)
    assert peak_shared == 1 + 4  # one shared full block + one private last block per sample
    assert peak_separate == 4 * 2
    assert_no_leaks(separate)


def test_parallel_samples_differ_and_reproduce(llm: LLM) -> None:
    params = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=12, ignore_eos=True)
    first = llm.generate([PROMPT], params)[0]
    again = llm.generate([PROMPT], params)[0]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]
    assert len({tuple(c.token_ids) for c in first.outputs}) > 1
    assert [c.index for c in first.outputs] == [0, 1, 2, 3]
    assert_no_leaks(llm)


def test_seeded_sampling_ignores_the_batch_around_it(llm: LLM) -> None:
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate([PROMPT], params)[0].outputs[0].token_ids
    others = [list(range(40, 40 + k)) for k in (3, 30, 50)]
    crowd = llm.generate([*others, PROMPT], [SamplingParams(temperature=1.0, max_tokens=20)] * 3 + [params])
    assert crowd[-1].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=99, max_tokens=16, ignore_eos=True)
    assert llm.generate([PROMPT], other_seed)[0].outputs[0].token_ids != alone
    assert_no_leaks(llm)


@pytest.mark.parametrize("length_penalty", [0.5, 1.0, 2.0])
def test_beam_search_matches_hf(tiny_llama_dir: Path, llm: LLM, length_penalty: float) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32)
    prompts = [PROMPT, list(range(100, 107)), [5] * 33]
    params = SamplingParams(n=2, best_of=4, use_beam_search=True, temperature=0.0, max_tokens=12,
                            length_penalty=length_penalty)
    outputs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outputs, strict=True):
        ids = torch.tensor([prompt])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), num_beams=4, num_return_sequences=2,
                          max_new_tokens=12, do_sample=False, length_penalty=length_penalty,
                          pad_token_id=hf.config.eos_token_id)
        want = [_strip_pad(row[len(prompt):].tolist(), hf.config.eos_token_id) for row in ref]
        assert [c.token_ids for c in out.outputs] == want
    assert_no_leaks(llm)


def _strip_pad(tokens: list[int], eos: int) -> list[int]:
    """HF pads finished beams with the pad (= eos) id after their EOS."""
    if eos in tokens:
        return tokens[: tokens.index(eos) + 1]
    return tokens


def test_best_of_returns_the_most_likely_samples(llm: LLM) -> None:
    params = SamplingParams(n=2, best_of=5, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True)
    out = llm.generate([PROMPT], params)[0]
    assert len(out.outputs) == 2
    assert out.outputs[0].cumulative_logprob >= out.outputs[1].cumulative_logprob
    assert_no_leaks(llm)


def test_logprobs_and_top_alternatives(llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=3)
    choice = llm.generate([PROMPT], params)[0].outputs[0]
    assert choice.logprobs is not None and len(choice.logprobs) == 5
    for token, entry in zip(choice.token_ids, choice.logprobs, strict=True):
        assert entry["token_id"] == token
        assert len(entry["top_logprobs"]) == 3
        # Greedy: the sampled token is the most likely one.
        assert entry["top_logprobs"][0][0] == token
        assert entry["logprob"] == pytest.approx(entry["top_logprobs"][0][1])


def test_stop_token_and_length_finish_reasons(llm: LLM) -> None:
    greedy = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))[0]
    tokens = greedy.outputs[0].token_ids
    assert greedy.outputs[0].finish_reason == "length" and len(tokens) == 10
    stop_at = tokens[4]
    stopped = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[stop_at]))[0]
    assert stopped.outputs[0].finish_reason == "stop"
    assert stopped.outputs[0].token_ids == tokens[: tokens.index(stop_at) + 1]
    assert_no_leaks(llm)


def test_abort_mid_generation_frees_blocks(llm: LLM) -> None:
    engine = llm.engine
    engine.add_request("to-abort", PROMPT, SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    engine.add_request("to-keep", PROMPT, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.block_manager.num_used_blocks > 0
    assert engine.abort_request("to-abort")
    assert not engine.abort_request("to-abort")
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == ["to-keep"]
    assert_no_leaks(llm)


def test_prefix_cache_hits_are_reported_as_cached_prompt_tokens(llm: LLM) -> None:
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, *range(250, 292)]  # 50 tokens: three full blocks of 16 reused
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    first = llm.generate([prompt], params)[0]
    again = llm.generate([prompt], params)[0]
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens == 48
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert_no_leaks(llm)


def test_typical_p_reproduces_whatever_the_batch_and_path(llm: LLM) -> None:
    """A seeded typical_p request gives the same tokens again, in a crowd, and on the full sampler
    path (logprobs: the logits kept) as on the runner's picker path; typical_p=1.0 is no filter."""
    def tokens(params: SamplingParams) -> list[int]:
        return llm.generate([PROMPT], params)[0].outputs[0].token_ids

    params = SamplingParams(temperature=1.0, typical_p=0.3, seed=77, max_tokens=16, ignore_eos=True)
    alone = tokens(params)
    assert tokens(params) == alone
    others = [list(range(40, 40 + k)) for k in (3, 30, 50)]
    crowd = llm.generate([*others, PROMPT], [SamplingParams(temperature=1.0, max_tokens=20, top_k=5)] * 3 + [params])
    assert crowd[-1].outputs[0].token_ids == alone
    assert tokens(SamplingParams(temperature=1.0, typical_p=0.3, seed=77, max_tokens=16, ignore_eos=True,
                                 logprobs=1)) == alone
    plain = SamplingParams(temperature=1.0, seed=77, max_tokens=16, ignore_eos=True)
    assert tokens(SamplingParams(temperature=1.0, typical_p=1.0, seed=77, max_tokens=16, ignore_eos=True)) \
        == tokens(plain)
    assert tokens(plain) != alone  # the filter does cut
    assert_no_leaks(llm)
