"""Suffix-decoding proposals (SuffixDecoding, arXiv 2411.04975; the method of vLLM's and
ArcticInference's `"suffix"`): each sequence has a suffix trie over its own prompt and output
(`SuffixIndex`), and the engine keeps one bounded trie over the outputs of recently finished
requests (`SuffixCache`, first in first out). A step proposes the better-scoring draft of the
two for the sequence's last tokens (`SuffixTrie.speculate`), so a request gains both from
repeating its context and from answers that earlier requests already gave.

A finished output enters the global trie when its sequence is released (so concurrent requests
see each other's output only once it is finished; ArcticInference adds tokens as they come)."""

from __future__ import annotations

from collections import OrderedDict

from engine.spec.config import SpeculativeConfig
from engine.spec.suffix_trie import SuffixTrie

LOCAL = 0  # the one sequence id of a request's own trie


class SuffixCache:
    """The global trie of recent outputs, at most `max_cached_requests` of them."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.trie = SuffixTrie(config.suffix_decoding_max_tree_depth)
        self.cached: OrderedDict[int, None] = OrderedDict()  # seq ids in the trie, oldest first

    def add_output(self, seq_id: int, tokens: list[int]) -> None:
        """Cache one finished sequence's output (once), evicting the oldest beyond the limit."""
        limit = self.config.suffix_decoding_max_cached_requests
        if limit == 0 or seq_id in self.cached or not tokens:
            return
        self.trie.extend(seq_id, tokens)
        self.cached[seq_id] = None
        while len(self.cached) > limit:
            oldest, _ = self.cached.popitem(last=False)
            self.trie.remove(oldest)

    def index(self) -> SuffixIndex:
        return SuffixIndex(self)

    def clear(self) -> None:
        """Forget every cached output (sequences' own tries are not touched)."""
        self.trie = SuffixTrie(self.config.suffix_decoding_max_tree_depth)
        self.cached.clear()


class SuffixIndex:
    """One sequence's own trie (prompt and output), kept current with its tokens, which may only
    grow between calls, and its proposals against it and the global cache."""

    def __init__(self, cache: SuffixCache) -> None:
        self.cache = cache
        self.local = SuffixTrie(cache.config.suffix_decoding_max_tree_depth)
        self.indexed = 0

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to `k` tokens continuing `tokens`; [] when no suffix of them occurred before."""
        self.local.extend(LOCAL, tokens[self.indexed :])
        self.indexed = len(tokens)
        if k <= 0:
            return []
        c = self.cache.config
        context = tokens[-c.suffix_decoding_max_tree_depth :]
        args = (k, c.suffix_decoding_max_spec_factor, 0.0, c.suffix_decoding_min_token_prob)
        draft = self.local.speculate(context, *args)
        if self.cache.cached:
            shared = self.cache.trie.speculate(context, *args)
            if shared.score > draft.score:
                draft = shared
        return draft.tokens
