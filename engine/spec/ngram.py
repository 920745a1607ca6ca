"""Prompt-lookup proposals: the longest suffix n-gram (n from `max_n` down to `min_n`) of a
sequence's tokens that occurred earlier in prompt + output, and the tokens that followed its
latest earlier occurrence.

    tokens   ... a b c d e ... x b c d        (max_n 3)
    suffix   b c d  ended earlier at the `d` before `e`  →  propose  e ...

The index is incremental: each call indexes only the n-grams ending at positions not seen
yet, so a step costs O(new tokens x (max_n - min_n + 1)), not a scan of the context."""

from __future__ import annotations


class NgramIndex:
    """Where each n-gram of one token list last ended (n in [min_n, max_n]). The list may only
    grow between calls (a sequence's tokens never shrink)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self.last_end: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # n-grams ending at positions below this are in `last_end`

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to `k` tokens that followed the latest earlier occurrence of the longest matching
        suffix; [] when no suffix of length >= min_n occurred before."""
        length = len(tokens)
        self._index(tokens, length - 1)  # every n-gram ending before the last token
        if k <= 0:
            return []
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            end = self.last_end.get(tuple(tokens[length - n :]))
            if end is not None:
                return tokens[end + 1 : end + 1 + k]
        return []

    def _index(self, tokens: list[int], upto: int) -> None:
        table = self.last_end
        for end in range(self.indexed, upto):
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                table[tuple(tokens[end - n + 1 : end + 1])] = end
        self.indexed = max(self.indexed, upto)
