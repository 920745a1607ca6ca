"""Who proposes, when, and how well it went: one `Speculator` per scheduler, torch-free.

A running decode sequence gets up to K proposals (`NgramIndex` for "ngram", `SuffixIndex` and the
shared `SuffixCache` of finished outputs for "suffix") when speculation can pay:

- the step runs at most `disable_by_batch_size` sequences (a large batch is already
  compute-bound, verifying K extra tokens per row would cost more than it saves);
- the request's sampling is one the verifier reproduces exactly (`eligible`);
- the sequence's recent acceptance rate is at least `min_acceptance_rate`; below it the
  sequence stops proposing for a cool-down that doubles on each relapse (16, 32 ... 256 steps);
- speculative steps actually yield more tokens per second than plain decode steps on this
  machine (`observe_step`: tokens over seconds of the last `RATE_WINDOW` steps of each kind,
  leaving out steps that took over twice the median step time, so a few steps slowed by other
  work on the machine do not decide, while every step's yield counts): when they do not (a CPU whose GEMM
  is slow at a few rows), nobody proposes for a cool-down (16 ... 256 steps, doubling while the
  verdict repeats, back to 16 once speculation is found faster), during which the plain rate is
  measured again.

Counters: proposed and accepted tokens, verified rows (mean acceptance length =
1 + accepted / rows: tokens a verified row yields)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from statistics import median
from typing import Any, Protocol

from engine.sched.sequence import Sequence
from engine.spec.config import SpeculativeConfig
from engine.spec.ngram import NgramIndex
from engine.spec.suffix import SuffixCache

EMA_WEIGHT = 0.3  # weight of the latest verified row in the acceptance average
BASE_COOLDOWN = 16  # decode steps without proposals after the first time acceptance falls too low
MAX_COOLDOWN = 256
RATE_WINDOW = 8  # recent steps of each kind whose tokens/s the pause rule compares
OUTLIER_FACTOR = 2.0  # steps slower than this x the window's median step time are left out
MIN_SPEC_STEPS = 4  # speculative steps between verdicts (the first waits for a full window)


class SeqIndex(Protocol):
    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to `k` tokens continuing `tokens` (which only grow between calls); k = 0 only
        brings the index up to date."""
        ...


@dataclass(slots=True)
class SeqSpecState:
    """One sequence's proposer index and acceptance record."""

    index: SeqIndex
    rate: float = 1.0  # moving average of accepted / proposed
    rows: int = 0
    cooldown: int = 0  # decode steps left without proposals
    relapses: int = 0


@dataclass(slots=True)
class SpecCounters:
    proposed_tokens: int = 0
    accepted_tokens: int = 0
    verified_rows: int = 0
    pauses: int = 0  # times speculation paused itself because it was slower than plain decoding
    accepted_lengths: dict[int, int] = field(default_factory=dict)  # accepted proposals per row -> rows


def steady_rate(steps: deque[tuple[float, int]]) -> float:
    """Tokens per second over `steps` (seconds, tokens), leaving out the steps that took more than
    `OUTLIER_FACTOR` x the median step time (slowed by other work on the machine). Every kept
    step's yield counts: the median of per-step rates, the rule before, sits on the rejected
    rows' one token whenever more than half the window missed, and paused speculation that was
    still faster on average."""
    limit = OUTLIER_FACTOR * median(seconds for seconds, _ in steps)
    kept = [(seconds, tokens) for seconds, tokens in steps if seconds <= limit]
    return sum(tokens for _, tokens in kept) / sum(seconds for seconds, _ in kept)


def eligible(seq: Sequence) -> bool:
    """True when verification reproduces this sequence's sampling exactly: anything but beam
    search. Logprobs, n > 1 / best_of, grammars, penalties, logit bias and min_tokens take each
    position's logits (`engine.sample.verify.draw_from_logits`)."""
    return not seq.request.params.use_beam_search


class Speculator:
    """Proposals, the policy that gates them, and the acceptance record."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.suffix_cache = SuffixCache(config) if config.method == "suffix" else None
        self.states: dict[int, SeqSpecState] = {}
        self.counters = SpecCounters()
        # (seconds, tokens) of recent decode steps without proposals, and with
        self.plain_steps: deque[tuple[float, int]] = deque(maxlen=RATE_WINDOW)
        self.spec_window: deque[tuple[float, int]] = deque(maxlen=RATE_WINDOW)
        self.spec_steps = 0  # speculative steps since the last verdict
        self.pause = 0  # steps left without proposals for anyone
        self.pauses = 0  # verdicts "slower" in a row (the next pause is BASE_COOLDOWN << pauses)

    def allows_batch(self, num_running_seqs: int) -> bool:
        """Called once per step: whether this step may propose."""
        if self.pause > 0:
            self.pause -= 1
            return False
        return num_running_seqs <= self.config.disable_by_batch_size

    def observe_step(self, seconds: float, num_tokens: int, speculative: bool) -> None:
        """A decode-only step's wall time and the tokens it produced (no prefill in it); every
        `MIN_SPEC_STEPS` speculative steps, the verdict (pause or not)."""
        if seconds <= 0 or num_tokens <= 0:
            return
        if not speculative:
            self.plain_steps.append((seconds, num_tokens))
            return
        self.spec_window.append((seconds, num_tokens))
        self.spec_steps += 1
        if not self.plain_steps or len(self.spec_window) < RATE_WINDOW or self.spec_steps < MIN_SPEC_STEPS:
            return
        self.spec_steps = 0
        if steady_rate(self.spec_window) >= steady_rate(self.plain_steps):
            self.pauses = 0
            return
        self.pause = min(MAX_COOLDOWN, BASE_COOLDOWN << self.pauses)
        self.pauses += 1
        self.counters.pauses += 1
        self.spec_window.clear()

    def propose(self, seq: Sequence, limit: int) -> list[int]:
        """Up to min(K, limit) proposed tokens following `seq.token_ids`, or [] when this
        sequence should not speculate now."""
        if limit <= 0 or not eligible(seq):
            return []
        state = self.states.get(seq.seq_id)
        if state is None:
            state = self.states[seq.seq_id] = SeqSpecState(self._new_index())
        if state.cooldown > 0:
            state.cooldown -= 1
            state.index.propose(seq.token_ids, 0)  # keep the index current
            return []
        return state.index.propose(seq.token_ids, min(self.config.num_speculative_tokens, limit))

    def record(self, seq: Sequence, num_proposed: int, num_accepted: int) -> None:
        """One verified row's outcome."""
        c = self.counters
        c.proposed_tokens += num_proposed
        c.accepted_tokens += num_accepted
        c.verified_rows += 1
        c.accepted_lengths[num_accepted] = c.accepted_lengths.get(num_accepted, 0) + 1
        state = self.states.get(seq.seq_id)
        if state is None or num_proposed <= 0:
            return
        state.rows += 1
        state.rate += EMA_WEIGHT * (num_accepted / num_proposed - state.rate)
        if state.rows >= 3 and state.rate < self.config.min_acceptance_rate:
            state.cooldown = min(MAX_COOLDOWN, BASE_COOLDOWN << state.relapses)
            state.relapses += 1
            state.rate, state.rows = 1.0, 0

    def release(self, seq: Sequence) -> None:
        """Forget a finished or aborted sequence (suffix: its output joins the shared cache)."""
        self.states.pop(seq.seq_id, None)
        if self.suffix_cache is not None:
            self.suffix_cache.add_output(seq.seq_id, seq.output_token_ids)

    def stats(self) -> dict[str, Any]:
        """Flat numbers (the heartbeat flattens one level of nesting)."""
        c = self.counters
        return {
            "proposed_tokens": c.proposed_tokens,
            "accepted_tokens": c.accepted_tokens,
            "verified_rows": c.verified_rows,
            "acceptance_rate": c.accepted_tokens / c.proposed_tokens if c.proposed_tokens else 0.0,
            "mean_acceptance_length": 1.0 + c.accepted_tokens / c.verified_rows if c.verified_rows else 0.0,
            "pauses": c.pauses,
        }

    def accepted_lengths(self) -> dict[str, int]:
        """Verified rows by the number of proposals they accepted ("0" .. "K")."""
        return {str(n): rows for n, rows in sorted(self.counters.accepted_lengths.items())}


    def _new_index(self) -> SeqIndex:
        if self.suffix_cache is not None:
            return self.suffix_cache.index()
        return NgramIndex(self.config.prompt_lookup_min, self.config.prompt_lookup_max)
