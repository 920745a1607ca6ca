"""Exact verification of proposals: a row of 1 + k tokens (the last sampled token and k
proposals) yields the target model's token at each of its k + 1 positions, drawn exactly as
without speculation (the step plan's `spec_picker`: the greedy argmax, or the inverse-CDF draw
keyed by (seed, stream, output-token index)); the proposals are accepted up to the first one that
differs from the target's token, and the target's token there (or the bonus token after k
accepted) is added.

For a deterministic proposer (a point mass q on proposal d) this is Leviathan et al.'s
rejection sampling (arXiv 2211.17192) realized by coupling: the proposal is accepted with
probability p(d) (the draw lands on d), and on rejection the token is the draw given that it is
not d, which is p with d removed, renormalized. So every token has the distribution of plain
sampling, and a seeded request gives the very tokens it gives without speculation: the same
uniform decides each index. The verified positions attend as decode rows (one per position, over
the sequence's block table, `engine.model.runner`), so their attention sums are plain decoding's,
bit for bit; what may still differ is a linear layer's arithmetic at 1 + k rows against 1 (where a
kernel's rows depend on the batch, as a different batch can make a near tie break the other way
without speculation).

A request that asks for logprobs, ranks candidates by them (best_of), has a grammar, or whose
logits a processor changes (penalties, logit bias, min_tokens), takes its positions' tokens from
their logits instead (`draw_from_logits`: `SampleStage`'s path for a plain row, position by
position: logprobs from the raw logits, the processors and the grammar mask as if the proposals
before the position had been sampled, then the draw keyed by the output-token index the position
will have; the plan's `spec_logit_ranges` say which rows); the accepted tokens keep their logprobs."""

from __future__ import annotations

import torch

from engine.sample.grammar import Grammar, GrammarCompiler
from engine.sample.penalty_counts import PenaltyCounts
from engine.sample.processors import apply_processors, changes_logits
from engine.sample.sampler import Logprobs, Sampler, SamplingBatch
from engine.sample.step_plan import StepPlan
from engine.sched.output import ScheduledSeq, SpecResult
from engine.sched.sequence import Sequence, TokenConstraint


def position_grammars(grammar: TokenConstraint, proposals: list[int]) -> list[TokenConstraint]:
    """The grammar state before each of the 1 + k positions: copies advanced over the proposals
    before it (the sequence's own state is advanced only by the tokens it keeps). Past a proposal
    the grammar refuses, that copy stays refused: the position before it rejects the proposal."""
    states = [grammar.fork()]
    for token in proposals:
        state = states[-1].fork()
        state.consume(token)
        states.append(state)
    return states


def draw_from_logits(item: ScheduledSeq, logits: torch.Tensor, sampler: Sampler, eos_token_ids: list[int],
                     grammars: GrammarCompiler | None = None,
                     ) -> tuple[torch.Tensor, tuple[list[float], list[list[tuple[int, float]]]]]:
    """The target's token at each of `item`'s 1 + k positions from their `logits` (changed in
    place), as a plain row takes it: logprobs and top alternatives from the raw logits, then the
    penalties, logit bias, min_tokens and grammar of a sequence that had sampled the proposals
    before the position, then the greedy argmax or the seeded draw at the position's output-token
    index (keyed by the sequence's own stream: a forked candidate of n > 1 keeps its own)."""
    seq, positions = item.seq, item.num_spec + 1
    proposals = item.token_ids[len(item.token_ids) - item.num_spec :]
    params = seq.request.params
    batch = SamplingBatch([params] * positions, [seq.stream] * positions,
                          [seq.num_output_tokens + j for j in range(positions)], logits.device)
    logprobs = Logprobs(logits, batch)
    if changes_logits(seq, eos_token_ids):
        views = [Sequence(request=seq.request, index=seq.index, token_ids=seq.token_ids + proposals[:j],
                          num_prompt_tokens=seq.num_prompt_tokens, grammar=seq.grammar) for j in range(positions)]
        apply_processors(logits, views, eos_token_ids, PenaltyCounts())
    if seq.grammar is not None and grammars is not None:
        states = position_grammars(seq.grammar, proposals)
        grammars.apply(logits, list(range(positions)), [g for g in states if isinstance(g, Grammar)])
    tokens = sampler(logits, batch)
    return tokens, logprobs.gather(tokens)


def verify(plan: StepPlan, tokens: torch.Tensor, logits: list[torch.Tensor], sampler: Sampler,
           eos_token_ids: list[int], grammars: GrammarCompiler | None = None) -> list[SpecResult]:
    """The verified speculative rows of a step: the target's token at each position (`tokens`, by
    the plan's `spec_picker`), those of the rows that need their logits drawn from them
    (`draw_from_logits`; `logits` holds one tensor per `spec_logit_ranges` range), then `accept`."""
    if not plan.spec:
        return []
    chosen: dict[int, tuple[list[float], list[list[tuple[int, float]]]]] = {}
    for (i, (lo, hi)), item_logits in zip(plan.spec_logit_ranges.items(), logits, strict=True):
        tokens[lo:hi], chosen[i] = draw_from_logits(plan.spec[i], item_logits, sampler, eos_token_ids, grammars)
    return accept(list(plan.spec), tokens, chosen)


def accept(items: list[ScheduledSeq], tokens: torch.Tensor,
           logprobs: dict[int, tuple[list[float], list[list[tuple[int, float]]]]] | None = None) -> list[SpecResult]:
    """Per speculative row: the accepted proposals plus the target's next token (with their
    logprobs for the item indices in `logprobs`: each position's, as `draw_from_logits` gave)."""
    flat = tokens.tolist()
    results = []
    offset = 0
    for i, item in enumerate(items):
        k = item.num_spec
        proposals = item.token_ids[len(item.token_ids) - k :]
        targets = flat[offset : offset + k + 1]
        offset += k + 1
        accepted = 0
        while accepted < k and targets[accepted] == proposals[accepted]:
            accepted += 1
        result = SpecResult(seq=item.seq, tokens=[*proposals[:accepted], targets[accepted]], num_accepted=accepted,
                            num_proposed=k)
        values, tops = logprobs.get(i, ([], [])) if logprobs is not None else ([], [])
        if values:  # one per position (`draw_from_logits`), when the request asks or ranks by them
            result.logprobs, result.top_logprobs = values[: accepted + 1], tops[: accepted + 1]
        results.append(result)
    return results
