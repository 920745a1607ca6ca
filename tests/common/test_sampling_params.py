"""SamplingParams: validation a user can act on, and a lossless msgpack round trip."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from common.sampling_params import ParamError, SamplingParams, check_limits


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens must be at least 1"),
        ({"temperature": -0.1}, "temperature must be a finite number >= 0"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k must be -1 or 0"),
        ({"n": 0}, "n must be at least 1"),
        ({"n": 3, "best_of": 2}, "best_of must be >= n"),
        ({"logprobs": 21}, "logprobs must be between 0 and 20"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens must be between 0 and max_tokens=10"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"seed": 2**70}, "seed must fit in 64 bits"),
        ({"n": 1.5}, "n must be an integer"),
        ({"use_beam_search": True, "best_of": 4}, "beam search is deterministic and needs temperature=0"),
        ({"use_beam_search": True, "temperature": 0, "top_p": 0.9}, "beam search does not use top_p"),
        ({"early_stopping": True}, "early_stopping only applies to beam search"),
        ({"length_penalty": 2.0}, "length_penalty only applies to beam search"),
        ({"use_beam_search": True, "temperature": 0, "early_stopping": "sometimes"}, "early_stopping must be"),
        ({"typical_p": 0.0}, r"typical_p must be in \(0, 1\]"),
        ({"typical_p": 1.5}, "typical_p"),
        ({"use_beam_search": True, "temperature": 0, "typical_p": 0.5}, "beam search does not use"),
        ({"temperature": 2.5}, "temperature must be a finite number >= 0 and at most 2"),
        ({"use_beam_search": True, "temperature": 0, "presence_penalty": 0.5}, "do not apply to beam search"),
        ({"stop_token_ids": 5}, "stop_token_ids must be a list"),
        ({"early_stopping": 1}, "early_stopping must be"),
    ],
)
def test_invalid_params_say_what_to_fix(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(("kwargs", "param", "code"), [
    ({"n": "2"}, "n", "invalid_type"), ({"temperature": float("inf")}, "temperature", "invalid_type"),
    ({"ignore_eos": 1}, "ignore_eos", "invalid_type"), ({"logit_bias": {3: "x"}}, "logit_bias", "invalid_type"),
    ({"top_p": 0}, "top_p", "invalid_value"), ({"stop_token_ids": [-1]}, "stop_token_ids", "invalid_value"),
])
def test_errors_name_the_field_and_say_type_or_value(kwargs: dict[str, Any], param: str, code: str) -> None:
    with pytest.raises(ParamError) as error:
        SamplingParams(**kwargs)
    assert (error.value.param, error.value.code) == (param, code)


def test_integral_numbers_are_integers_and_numbers_floats() -> None:
    params = SamplingParams(n=2.0, max_tokens=8.0, seed=5.0, temperature=1, top_p=1, logit_bias={3.0: 2})
    assert (params.n, params.max_tokens, params.seed) == (2, 8, 5) and isinstance(params.n, int)
    assert isinstance(params.temperature, float) and isinstance(params.top_p, float)
    assert params.logit_bias == {3: 2.0} and isinstance(params.logit_bias[3], float)


def test_check_limits_caps_what_validation_accepted() -> None:
    check_limits(SamplingParams(n=4, max_tokens=100, logprobs=5), max_n=4, max_tokens=100, max_logprobs=5)
    for kwargs, param in (({"n": 5}, "n"), ({"n": 2, "best_of": 5}, "best_of"), ({"max_tokens": 101}, "max_tokens"),
                          ({"logprobs": 6}, "logprobs"), ({"prompt_logprobs": 6}, "prompt_logprobs")):
        with pytest.raises(ParamError) as error:
            check_limits(SamplingParams(**kwargs), max_n=4, max_tokens=100, max_logprobs=5)
        assert error.value.param == param


def test_defaults_and_properties() -> None:
    params = SamplingParams()
    assert not params.is_greedy and params.num_candidates == 1
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(temperature=1e-7).is_greedy
    beam = SamplingParams(use_beam_search=True, temperature=0, n=2, best_of=4, early_stopping="never")
    assert not beam.is_greedy and beam.num_candidates == 4
    assert SamplingParams(top_k=0).top_k == 0  # 0 and -1 both mean "off"


def test_from_dict_ignores_unknown_keys_and_validates() -> None:
    assert SamplingParams.from_dict({"n": 2, "future_knob": 1}).n == 2
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams.from_dict({"max_tokens": 0})


params_strategy = st.builds(
    SamplingParams,
    n=st.integers(1, 4),
    temperature=st.floats(0, 2),
    top_p=st.floats(0.01, 1),
    top_k=st.integers(-1, 100),
    min_p=st.floats(0, 1),
    seed=st.none() | st.integers(-(2**63), 2**64 - 1),
    max_tokens=st.integers(16, 64),
    min_tokens=st.integers(0, 16),
    stop_token_ids=st.lists(st.integers(0, 50000), max_size=4),
    ignore_eos=st.booleans(),
    logprobs=st.none() | st.integers(0, 20),
    typical_p=st.floats(0.01, 1),
)


@given(params_strategy)
def test_msgpack_round_trip(params: SamplingParams) -> None:
    wire = msgpack.unpackb(msgpack.packb(params.to_dict()))
    assert SamplingParams.from_dict(wire) == params
