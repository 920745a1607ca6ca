"""Exact verification of proposals: a row of 1 + k tokens (the last sampled token and k
proposals) yields the target model's token at each of its k + 1 positions, drawn exactly as
without speculation (`TokenPlan`: the greedy argmax, or the inverse-CDF draw keyed by (seed,
stream, output-token index)); the proposals are accepted up to the first one that differs from
the target's token, and the target's token there (or the bonus token after k accepted) is added.

For a deterministic proposer (a point mass q on proposal d) this is Leviathan et al.'s
rejection sampling (arXiv 2211.17192) realized by coupling: the proposal is accepted with
probability p(d) (the draw lands on d), and on rejection the token is the draw given that it is
not d, which is p with d removed, renormalized. So every token has the distribution of plain
sampling, and a seeded request gives the very tokens it gives without speculation: the same
uniform decides each index. The verified positions attend as decode rows (one per position, over
the sequence's block table, `engine.model.runner`), so their attention sums are plain decoding's,
bit for bit; what may still differ is a linear layer's arithmetic at 1 + k rows against 1 (where a
kernel's rows depend on the batch, as a different batch can make a near tie break the other way
without speculation)."""

from __future__ import annotations

import torch

from engine.sample.sampler import TokenPlan, is_filtered, uniform
from engine.sched.output import ScheduledSeq, SpecResult


def verify_plan(items: list[ScheduledSeq]) -> TokenPlan:
    """How to take the target's token at every position of the speculative rows (in order)."""
    random_rows: list[int] = []
    temperatures: list[float] = []
    uniforms: list[float] = []
    filters: tuple[list[int], list[float], list[float]] = ([], [], [])
    filtered = False
    row = 0
    for item in items:
        seq = item.seq
        p = seq.request.params
        for j in range(item.num_spec + 1):
            if not p.is_greedy:
                random_rows.append(row)
                temperatures.append(p.temperature)
                uniforms.append(uniform(p.seed, seq.stream, seq.num_output_tokens + j))
                filters[0].append(p.top_k)
                filters[1].append(p.top_p)
                filters[2].append(p.min_p)
                filtered = filtered or is_filtered(p)
            row += 1
    return TokenPlan(random_rows, temperatures, uniforms, filters if filtered else None)


def accept(items: list[ScheduledSeq], tokens: torch.Tensor) -> list[SpecResult]:
    """Per speculative row: the accepted proposals plus the target's next token."""
    flat = tokens.tolist()
    results = []
    offset = 0
    for item in items:
        k = item.num_spec
        proposals = item.token_ids[len(item.token_ids) - k :]
        targets = flat[offset : offset + k + 1]
        offset += k + 1
        accepted = 0
        while accepted < k and targets[accepted] == proposals[accepted]:
            accepted += 1
        results.append(SpecResult(item.seq, [*proposals[:accepted], targets[accepted]], accepted, k))
    return results
