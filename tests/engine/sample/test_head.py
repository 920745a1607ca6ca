"""Tokens asked of the model's head (`engine.sample.head`): with a quantized lm_head, whose int8
screen applies on every CPU, greedy rows go through the screen and drawn rows through the logits
in row groups, and every row gets the token the full logits give it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import engine.sample.head as head_module
from engine.model import load_model
from engine.model.quant_linear import QuantLinear
from engine.model.quant_screen import QuantLogitScreen
from engine.sample.head import choose_tokens
from engine.sample.sampler import Draws, TokenPlan
from ops.quant import Q8_0
from ops.reference import quant as ref


@pytest.mark.parametrize("group_rows", [1, 7, 64])
def test_screened_greedy_and_grouped_draws_pick_what_the_full_logits_pick(
        tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch, group_rows: int) -> None:
    model = load_model(tiny_llama_dir)
    weight = model.lm_head.weight.detach().float()
    model.lm_head = QuantLinear(weight.shape[1], [(Q8_0, ref.quantize(weight, Q8_0.type_id))], int8_activations=False)
    head = model.head
    assert isinstance(head.greedy_screen(), QuantLogitScreen) and head.vocab_size == weight.shape[0]
    monkeypatch.setattr(head_module, "LOGITS_GROUP_BYTES", group_rows * 4 * head.vocab_size)
    hidden = torch.randn(40, weight.shape[1], generator=torch.Generator().manual_seed(5))
    logits = head.logits(hidden)

    greedy = TokenPlan(Draws())
    assert torch.equal(choose_tokens(head, hidden, greedy), logits.max(dim=-1).indices)  # the screen alone
    random_rows = [0, 3, 7, 8, 30, 39]
    mixed = TokenPlan(Draws.unfiltered(random_rows, [0.6 + 0.1 * i for i in range(6)],
                                       [0.1 + 0.15 * i for i in range(6)]))
    assert torch.equal(choose_tokens(head, hidden, mixed), mixed(logits, 0))  # screen + grouped draws
    everyone = TokenPlan(Draws.unfiltered(list(range(40)), [0.8] * 40, [0.3] * 40))
    assert torch.equal(choose_tokens(head, hidden, everyone), everyone(logits, 0))  # grouped draws alone
