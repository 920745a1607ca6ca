"""A bounded-depth suffix trie with occurrence counts over one or more token sequences: every
substring of length <= `max_depth` of every sequence is a root path, and each node counts the
occurrences of its path. It answers the suffix-decoding question: for the longest suffixes of a
context that occurred before, which continuation followed them most often, and how likely was it.

    sequence  a b c a b d a b          (max_depth 3)
    "a b"     count 3, continued by c (1) and d (1): the third occurrence ends the sequence
    speculate([..., a, b]) → [c, a] with probabilities 1/2, 1/2 · 1/1

A node's `cont` is the number of its occurrences that have a next token (the sum of its children's
counts); continuation probabilities are child.count / node.cont, so the context's own occurrence
at the end of a sequence does not dilute them. Each node caches its most frequent child (`best`,
exact: only an incremented child can overtake it; rescanned after a removal; ties go to the
smaller token id, so the trie's answers do not depend on the order sequences came and went).

Appending a token costs O(max_depth) (one step down from each of the sequence's last max_depth
suffixes); removing a sequence replays it. Nodes are integers indexing flat lists, children are
one dict keyed by (node << 32 | token), so a node costs ~120 bytes, not a dict of its own."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

ROOT = 0
NONE = -1


@dataclass(frozen=True, slots=True)
class Draft:
    """A speculated continuation: its tokens, the sum of their estimated probabilities (`score`),
    and the length of the context suffix it continues."""

    tokens: list[int]
    score: float = 0.0
    match_len: int = 0


EMPTY = Draft([])


class SuffixTrie:
    """Counts of every substring of length <= `max_depth` of the sequences added (by id)."""

    def __init__(self, max_depth: int) -> None:
        if max_depth < 2:
            raise ValueError("a suffix trie needs max_depth >= 2")
        self.max_depth = max_depth
        self.children: dict[int, int] = {}
        self.token = [NONE]
        self.parent = [NONE]
        self.depth = [0]
        self.count = [0]
        self.cont = [0]
        self.best = [NONE]
        self.first_child = [NONE]
        self.next_sibling = [NONE]
        self._free: list[int] = []
        self._active: dict[int, list[int]] = {}  # per sequence: nodes of its last suffixes, shortest first
        self._tokens: dict[int, list[int]] = {}  # per sequence: what was added (replayed by `remove`)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._tokens

    @property
    def num_nodes(self) -> int:
        return len(self.count) - len(self._free)

    def extend(self, seq_id: int, tokens: Iterable[int]) -> None:
        """Append `tokens` to sequence `seq_id` (a new sequence starts empty)."""
        active = self._active.setdefault(seq_id, [])
        stored = self._tokens.setdefault(seq_id, [])
        limit = self.max_depth
        for token in tokens:
            stored.append(token)
            grown = [self._step(ROOT, token)]
            for node in active[: limit - 1]:
                grown.append(self._step(node, token))
            active[:] = grown

    def remove(self, seq_id: int) -> None:
        """Take sequence `seq_id`'s occurrences out of the counts (nodes left unused are freed)."""
        tokens = self._tokens.pop(seq_id, None)
        self._active.pop(seq_id, None)
        if tokens is None:
            return
        limit, children, count, cont = self.max_depth, self.children, self.count, self.cont
        touched: set[int] = set()  # parents whose children's counts fell
        active: list[int] = []
        for token in tokens:
            grown = []
            for node in [ROOT, *active[: limit - 1]]:
                child = children[node << 32 | token]
                count[child] -= 1
                cont[node] -= 1
                touched.add(node)
                grown.append(child)
            active = grown
        dead = sorted((child for node in touched for child in self._kids(node) if count[child] == 0),
                      key=self.depth.__getitem__, reverse=True)
        for node in dead:
            self._unlink(node)
        for node in touched:
            if node == ROOT or count[node] > 0:
                self._rescan_best(node)

    def speculate(self, context: list[int], max_tokens: int, max_spec_factor: float = 1.0,
                  max_spec_offset: float = 0.0, min_token_prob: float = 0.1) -> Draft:
        """The best-scoring continuation over every suffix of `context` that occurred with a next
        token: from the node of a suffix of length L, follow the most frequent child while the
        product of continuation probabilities stays >= `min_token_prob`, for at most
        min(max_tokens, L * max_spec_factor + max_spec_offset, max_depth - L) tokens. Ties go to
        the longer match."""
        best = EMPTY
        children, count, cont, best_child, token_of = self.children, self.count, self.cont, self.best, self.token
        n = len(context)
        for length in range(1, min(n, self.max_depth - 1) + 1):
            node = ROOT
            for token in context[n - length :]:
                node = children.get(node << 32 | token, NONE)
                if node == NONE:
                    return best
            if cont[node] == 0:  # no occurrence of this suffix was continued: none of a longer one was
                return best
            limit = min(max_tokens, int(length * max_spec_factor + max_spec_offset + 1e-6), self.max_depth - length)
            tokens: list[int] = []
            prob, score = 1.0, 0.0
            while len(tokens) < limit:
                child = best_child[node]
                if child == NONE:
                    break
                prob *= count[child] / cont[node]
                if prob < min_token_prob:
                    break
                tokens.append(token_of[child])
                score += prob
                node = child
            if tokens and score >= best.score:
                best = Draft(tokens, score, length)
        return best

    # ----- internals ---------------------------------------------------------------------------
    def _step(self, node: int, token: int) -> int:
        """The child of `node` for `token` (created when new), its count and `node`'s cont raised."""
        key = node << 32 | token
        child = self.children.get(key, NONE)
        if child == NONE:
            child = self._new(node, token)
            self.children[key] = child
        self.count[child] += 1
        self.cont[node] += 1
        if self._beats(child, self.best[node]):
            self.best[node] = child
        return child

    def _beats(self, child: int, other: int) -> bool:
        """More frequent, or as frequent with a smaller token id."""
        if other == NONE:
            return True
        a, b = self.count[child], self.count[other]
        return a > b or (a == b and self.token[child] < self.token[other])

    def _new(self, parent: int, token: int) -> int:
        values = (token, parent, self.depth[parent] + 1, 0, 0, NONE, NONE, self.first_child[parent])
        if self._free:
            node = self._free.pop()
            for column, value in zip(self._columns(), values, strict=True):
                column[node] = value
        else:
            node = len(self.count)
            for column, value in zip(self._columns(), values, strict=True):
                column.append(value)
        self.first_child[parent] = node
        return node

    def _columns(self) -> tuple[list[int], ...]:
        return (self.token, self.parent, self.depth, self.count, self.cont, self.best, self.first_child,
                self.next_sibling)

    def _kids(self, node: int) -> Iterable[int]:
        child = self.first_child[node]
        while child != NONE:
            yield child
            child = self.next_sibling[child]

    def _unlink(self, node: int) -> None:
        """Free a node whose count fell to 0 (its children are gone already: deepest first)."""
        parent = self.parent[node]
        previous, child = NONE, self.first_child[parent]
        while child != node:
            previous, child = child, self.next_sibling[child]
        if previous == NONE:
            self.first_child[parent] = self.next_sibling[node]
        else:
            self.next_sibling[previous] = self.next_sibling[node]
        if self.best[parent] == node:
            self.best[parent] = NONE
        del self.children[parent << 32 | self.token[node]]
        self.count[node], self.parent[node] = 0, NONE
        self._free.append(node)

    def _rescan_best(self, node: int) -> None:
        best = NONE
        for child in self._kids(node):
            if self._beats(child, best):
                best = child
        self.best[node] = best
