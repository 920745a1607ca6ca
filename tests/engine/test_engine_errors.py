"""Bad requests get a clear error on that request alone; the engine keeps serving and leaks nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.sampling_params import SamplingParams
from engine.llm import LLM
from engine.model.loader import ModelLoadError
from tests.engine.helpers import assert_no_leaks

OK = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> LLM:
    # 8 blocks of 16 tokens: 128 slots; max_model_len from the config is 512.
    return LLM(str(tiny_llama_dir), num_gpu_blocks=8, num_cpu_blocks=8, watermark=0.0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 0}, "n"),
        ({"n": 3, "best_of": 2}, "best_of"),
    ],
)
def test_bad_sampling_params_raise(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_bad_prompts_are_rejected_and_others_still_served(llm: LLM) -> None:
    engine = llm.engine
    engine.add_request("good-1", [1, 2, 3], OK)
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("too-long", [1] * 600, OK)
    with pytest.raises(ValueError, match="larger than the whole KV cache"):
        engine.add_request("too-big", [1] * 200, OK)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty", [], OK)
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request("bad-id", [1, 100000], OK)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("good-1", [1, 2, 3], OK)
    # stop_token_ids past the vocabulary once crashed the step that masked them (min_tokens)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request("bad-stop", [1, 2], SamplingParams(max_tokens=4, min_tokens=1, stop_token_ids=[10**9]))
    with pytest.raises(ValueError, match=r"need \d+ KV blocks .* the whole cache has 8"):
        engine.add_request("never-fits", [1, 2], SamplingParams(n=4, temperature=1.0, max_tokens=100,
                                                                ignore_eos=True))
    engine.add_request("good-2", [4, 5, 6], OK)
    done = []
    while engine.has_unfinished_requests():
        done += [o.request_id for o in engine.step() if o.finished]
    assert sorted(done) == ["good-1", "good-2"]
    assert_no_leaks(llm)


def test_offline_generate_rejects_bad_prompt_without_leaking(llm: LLM) -> None:
    with pytest.raises(ValueError):
        llm.generate([[1, 2, 3], [1] * 600], OK)
    assert_no_leaks(llm)
    assert len(llm.generate([[1, 2, 3]], OK)[0].outputs[0].token_ids) == 4


def test_unknown_model_path_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no-such-model"):
        LLM(str(tmp_path / "no-such-model"))


def test_generation_stops_at_max_model_len(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), max_model_len=40, kv_cache_memory=4 << 20)
    out = llm.generate([[1] * 30], SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True))[0]
    assert out.outputs[0].finish_reason == "length"
    assert len(out.outputs[0].token_ids) == 10
    assert_no_leaks(llm)
