"""The suffix trie against a brute-force count of substrings, removal as if never added, the
global cache's FIFO bound, and the suffix config."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from engine.spec.config import SpeculativeConfig
from engine.spec.suffix import SuffixCache
from engine.spec.suffix_trie import SuffixTrie


def _occurrences(seqs: list[list[int]], depth: int) -> tuple[Counter[tuple[int, ...]], Counter[tuple[int, ...]]]:
    """Occurrences of every substring up to `depth`, and those followed by a token."""
    occ: Counter[tuple[int, ...]] = Counter()
    cont: Counter[tuple[int, ...]] = Counter()
    for seq in seqs:
        for start in range(len(seq)):
            for length in range(1, min(depth, len(seq) - start) + 1):
                occ[tuple(seq[start : start + length])] += 1
                if start + length < len(seq):
                    cont[tuple(seq[start : start + length])] += 1
    return occ, cont


def _brute(seqs: list[list[int]], depth: int, context: list[int], k: int, factor: float,
           min_prob: float) -> tuple[list[int], float]:
    """The definition: for every continued suffix, the most frequent-child path (ties to the
    smaller token), best score, ties to the longer match."""
    occ, cont = _occurrences(seqs, depth)
    alphabet = sorted({t for seq in seqs for t in seq})
    best: tuple[list[int], float] = ([], 0.0)
    for length in range(1, min(len(context), depth - 1) + 1):
        path = tuple(context[len(context) - length :])
        if cont[path] == 0:
            break
        tokens: list[int] = []
        prob, score = 1.0, 0.0
        limit = min(k, int(length * factor + 1e-6), depth - length)
        while len(tokens) < limit and cont[path]:
            token = max(alphabet, key=lambda t: (occ[(*path, t)], -t))
            prob *= occ[(*path, token)] / cont[path]
            if prob < min_prob:
                break
            tokens.append(token)
            score += prob
            path = (*path, token)
        if tokens and score >= best[1] - 1e-9:
            best = (tokens, score)
    return best


def test_worked_example() -> None:
    trie = SuffixTrie(3)
    trie.extend(0, [1, 2, 3, 1, 2, 4, 1, 2])  # "1 2" continued by 3 once and 4 once
    draft = trie.speculate([1, 2], 4)
    assert (draft.tokens, draft.match_len) == ([3], 2)  # depth 3 leaves one token after a 2-token match
    assert draft.score == pytest.approx(0.5)
    assert trie.speculate([9], 4).tokens == []


@pytest.mark.parametrize("seed", range(6))
def test_speculation_equals_brute_force_while_growing(seed: int) -> None:
    rng = random.Random(seed)
    depth = rng.choice([3, 5, 8])
    seqs = [[rng.randrange(5) for _ in range(rng.randrange(5, 30))] for _ in range(3)]
    trie = SuffixTrie(depth)
    grown: list[list[int]] = [[] for _ in seqs]
    for step in range(40):
        i = step % len(seqs)
        chunk = seqs[i][len(grown[i]) : len(grown[i]) + rng.randrange(1, 4)]
        trie.extend(i, chunk)
        grown[i] += chunk
        context = grown[i][-rng.randrange(1, 10) :] if grown[i] else [0]
        k, factor, min_prob = rng.choice([2, 4, 8]), rng.choice([0.5, 1.0, 2.0]), rng.choice([0.0, 0.1, 0.4])
        draft = trie.speculate(context, k, factor, 0.0, min_prob)
        tokens, score = _brute(grown, depth, context, k, factor, min_prob)
        assert draft.tokens == tokens, (grown, context)
        assert draft.score == pytest.approx(score)


@pytest.mark.parametrize("seed", range(4))
def test_removal_is_as_if_never_added(seed: int) -> None:
    rng = random.Random(100 + seed)
    seqs = {i: [rng.randrange(4) for _ in range(rng.randrange(3, 25))] for i in range(6)}
    trie = SuffixTrie(5)
    for i, seq in seqs.items():
        trie.extend(i, seq)
    for gone in rng.sample(sorted(seqs), 4):
        trie.remove(gone)
        del seqs[gone]
        fresh = SuffixTrie(5)
        for i, seq in seqs.items():
            fresh.extend(i, seq)
        assert trie.num_nodes == fresh.num_nodes
        for _ in range(20):
            context = [rng.randrange(4) for _ in range(rng.randrange(1, 6))]
            assert trie.speculate(context, 4, 2.0) == fresh.speculate(context, 4, 2.0)
    for i in list(seqs):
        trie.remove(i)
    assert trie.num_nodes == 1 and not trie.children  # only the root is left


def test_global_cache_keeps_the_newest_outputs() -> None:
    config = SpeculativeConfig(num_speculative_tokens=4, method="suffix", suffix_decoding_max_cached_requests=2)
    cache = SuffixCache(config)
    for seq_id, output in enumerate([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]):
        cache.add_output(seq_id, output)
        cache.add_output(seq_id, output)  # released twice: cached once
    assert list(cache.cached) == [1, 2]
    index = cache.index()
    assert index.propose([50, 5, 6], 4) == [7, 8]  # from request 1's output
    assert index.propose([50, 5, 6, 60, 1, 2], 4) == []  # request 0 was evicted
    off = SuffixCache(SpeculativeConfig(num_speculative_tokens=4, method="suffix",
                                        suffix_decoding_max_cached_requests=0))
    off.add_output(0, [1, 2, 3])
    assert not off.cached


def test_own_context_proposals_and_the_length_limits() -> None:
    cache = SuffixCache(SpeculativeConfig(num_speculative_tokens=8, method="suffix",
                                          suffix_decoding_max_tree_depth=6))
    tokens = [7, 1, 2, 3, 4, 5, 6, 8, 1, 2, 3]
    assert cache.index().propose(tokens, 8) == [4, 5, 6]  # "1 2 3" matched: 3 tokens (factor 1, depth 6 - 3)
    assert cache.index().propose(tokens, 1) == [4]
    assert cache.index().propose([5, 9, 5], 8) == [9]  # a 1-token match proposes one token
    assert cache.index().propose([1, 2, 3], 8) == []


def test_suffix_config() -> None:
    spec = SpeculativeConfig.from_dict({"method": "suffix", "suffix_decoding_max_tree_depth": 16})
    assert spec.num_speculative_tokens == 16  # vLLM: K defaults to the tree depth
    assert SpeculativeConfig.from_dict({"method": "suffix", "num_speculative_tokens": 5,
                                        "suffix_decoding_min_token_prob": 0.2}).suffix_decoding_min_token_prob == 0.2
    for bad in ({"method": "suffix", "prompt_lookup_max": 3}, {"method": "ngram", "num_speculative_tokens": 2,
                                                                 "suffix_decoding_max_tree_depth": 8},
                {"method": "suffix", "suffix_decoding_max_tree_depth": 1},
                {"method": "suffix", "suffix_decoding_min_token_prob": "high"},
                {"method": "suffix", "suffix_decoding_max_cached_requests": -1}):
        with pytest.raises(ValueError):
            SpeculativeConfig.from_dict(bad)


def test_engine_cli_and_up_engine_args_accept_suffix() -> None:
    """`pagedserve engine --speculative-config JSON`, and the same flag inside `up --engine-args`
    (which shlex-splits the string onto the engine's command line)."""
    import argparse
    import shlex

    from engine.worker.cli import add_arguments, engine_config

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    up_form = '--speculative-config \'{"method": "suffix", "num_speculative_tokens": 6, ' \
              '"suffix_decoding_max_cached_requests": 8}\''
    spec = engine_config(parser.parse_args(shlex.split(up_form)), "m").speculative()
    assert spec is not None and spec.method == "suffix"
    assert (spec.num_speculative_tokens, spec.suffix_decoding_max_cached_requests) == (6, 8)
