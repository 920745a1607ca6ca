"""The prompt-lookup proposer and the speculative config."""

from __future__ import annotations

import random

import pytest

from engine.config import EngineConfig
from engine.spec.config import SpeculativeConfig
from engine.spec.ngram import NgramIndex


def _brute(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    """The reference: scan for the latest earlier occurrence of the longest suffix."""
    n_tokens = len(tokens)
    for n in range(min(hi, n_tokens - 1), lo - 1, -1):
        suffix = tokens[n_tokens - n :]
        for end in range(n_tokens - 2, n - 2, -1):
            if tokens[end - n + 1 : end + 1] == suffix:
                return tokens[end + 1 : end + 1 + k]
    return []


def test_longest_suffix_wins_over_a_later_shorter_match() -> None:
    #         0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 9, 7, 3, 8, 1, 2, 3]
    assert NgramIndex(1, 3).propose(tokens, 2) == [9, 7]  # "1 2 3" at 0..2, not "3" at 5
    assert NgramIndex(1, 1).propose(tokens, 2) == [8, 1]  # only "3": its latest earlier end is 5


def test_no_match_below_min_n_and_k_limits() -> None:
    tokens = [5, 6, 7, 1, 7]
    assert NgramIndex(2, 4).propose(tokens, 3) == []
    assert NgramIndex(1, 4).propose(tokens, 3) == [1, 7]  # stops at the end of the list
    assert NgramIndex(1, 4).propose(tokens, 1) == [1]
    assert NgramIndex(1, 4).propose([4], 3) == []


@pytest.mark.parametrize("seed", range(5))
def test_incremental_index_equals_a_fresh_scan(seed: int) -> None:
    rng = random.Random(seed)
    tokens = [rng.randrange(6) for _ in range(20)]
    index = NgramIndex(2, 4)
    for _ in range(60):
        assert index.propose(tokens, 3) == _brute(tokens, 3, 2, 4)
        tokens += [rng.randrange(6) for _ in range(rng.randrange(1, 4))]


def test_config_parses_vllm_form_and_refuses_bad_values() -> None:
    config = EngineConfig(model="m", speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                          "prompt_lookup_max": 4})
    spec = config.speculative()
    assert spec is not None and spec.num_speculative_tokens == 3
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (2, 4)
    assert SpeculativeConfig.from_dict({"num_speculative_tokens": 2, "prompt_lookup_min": 6}).prompt_lookup_max == 6
    assert EngineConfig(model="m").speculative() is None
    for bad in ({"method": "eagle", "num_speculative_tokens": 2}, {"method": "ngram"},
                {"num_speculative_tokens": 0}, {"num_speculative_tokens": 2, "prompt_lookup_min": 3,
                                                "prompt_lookup_max": 2},
                {"num_speculative_tokens": 2, "bogus": 1}, {"num_speculative_tokens": 2.5}):
        with pytest.raises(ValueError):
            EngineConfig(model="m", speculative_config=bad)


def test_engine_cli_flag_parses_json() -> None:
    import argparse

    from engine.worker.cli import add_arguments, engine_config

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    spec = engine_config(args, "m").speculative()
    assert spec is not None and spec.num_speculative_tokens == 3
    assert engine_config(parser.parse_args([]), "m").speculative() is None
    for bad in ("[1, 2]", "{not json"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--speculative-config", bad])
