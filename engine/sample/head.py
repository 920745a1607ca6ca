"""Tokens asked of the model's head: what the sampler may ask of the lm_head (`LogitsHead`) and
the strategies that take a `TokenPlan`'s tokens from it without keeping the logits matrix.

- Greedy rows, where the head has a greedy screen (`LogitsHead.greedy_screen`: a bf16 or
  int8-activation pass over the lm_head that computes exact fp32 logits only for the tokens that
  could still be the maximum), take the screen's argmax: the token of the fp32 logits.
- Every other row (and every row without a screen) takes its token from the head's logits made
  group by group (`tokens_in_groups`), each group small enough to stay in a CPU's last-level
  cache while the plan turns it into tokens.

A row gets the very token it gets from the full logits either way (`TokenPlan`, `draw`)."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from engine.sample.sampler import TokenPlan

LOGITS_GROUP_BYTES = 24 << 20  # fp32 logits of one group of rows: under a 32 MiB L3 with room to spare


class GreedyScreen(Protocol):
    """A pass over the lm_head that gives each row's argmax without the full fp32 logits."""

    def argmax(self, hidden: Tensor) -> Tensor:
        """int64 `[rows]`: the first maximum of each row's fp32 logits."""
        ...


class LogitsHead(Protocol):
    """The model's lm_head as the sampler sees it (`LlamaForCausalLM.head`)."""

    @property
    def vocab_size(self) -> int: ...

    def logits(self, hidden: Tensor) -> Tensor:
        """fp32 `[rows, vocab]` of the hidden rows (a row's logits do not depend on its batch-mates)."""
        ...

    def greedy_screen(self) -> GreedyScreen | None:
        """The head's greedy screen, or None where it has none."""
        ...


@torch.inference_mode()
def choose_tokens(head: LogitsHead, hidden: Tensor, plan: TokenPlan) -> Tensor:
    """One int64 token per hidden row, as `plan` takes it from the rows' fp32 logits: the greedy
    rows through the head's screen where it has one (`screened_greedy`), the others from their
    logits group by group (`tokens_in_groups`)."""
    screen = head.greedy_screen()
    if screen is None or len(plan.random_rows) == hidden.shape[0]:
        return tokens_in_groups(head, hidden, plan)
    return screened_greedy(screen, head, hidden, plan)


def screened_greedy(screen: GreedyScreen, head: LogitsHead, hidden: Tensor, plan: TokenPlan) -> Tensor:
    """The greedy rows' tokens by `screen`, the plan's random rows' from their logits."""
    if not plan.random_rows:
        return screen.argmax(hidden)
    random = torch.tensor(plan.random_rows, dtype=torch.long)
    greedy = torch.ones(hidden.shape[0], dtype=torch.bool)
    greedy[random] = False
    greedy_rows = greedy.nonzero().squeeze(1)
    tokens = torch.empty(hidden.shape[0], dtype=torch.long)
    tokens[greedy_rows] = screen.argmax(hidden.index_select(0, greedy_rows))
    tokens[random] = tokens_in_groups(head, hidden.index_select(0, random), plan.only_random())
    return tokens


def tokens_in_groups(head: LogitsHead, hidden: Tensor, plan: TokenPlan) -> Tensor:
    """The head's logits in groups of rows that fit in a CPU's last-level cache
    (`LOGITS_GROUP_BYTES`), each turned into tokens by `plan` while still cached, rather than one
    GEMM writing every row's logits to memory and a second pass reading them back. The logits are
    those of `head.logits(hidden)` (the GEMM's rows do not depend on how many rows it is given;
    the tests compare the two). On a GPU every row is one group."""
    group = hidden.shape[0] if hidden.is_cuda else max(1, LOGITS_GROUP_BYTES // (4 * head.vocab_size))
    if hidden.shape[0] <= group:
        return plan(head.logits(hidden), 0)
    return torch.cat([plan(head.logits(part), i * group) for i, part in enumerate(hidden.split(group))])
