"""`LogitScreen`: greedy tokens from the bf16 screen of an lm_head equal the argmax of its fp32
logits, in groups of any size, with non-finite rows decided by the full logits. Runs wherever
oneDNN runs bf16 GEMMs (without bf16 dot products it emulates them with AVX-512, and the engine
leaves the screen off; AVX2-only CPUs have no bf16 GEMM at all)."""

from __future__ import annotations

import pytest
import torch

import engine.model.logit_screen as logit_screen
import ops
from engine.model.logit_screen import LogitScreen

needs_bf16_gemm = pytest.mark.skipif(not ops.screen.bf16_packing_available(),
                                     reason="oneDNN has no bf16 GEMM on this CPU (AVX2 only)")


@pytest.fixture(scope="module")
def weight() -> torch.Tensor:
    return torch.randn(3001, 64, generator=torch.Generator().manual_seed(0)) * 0.1


@needs_bf16_gemm
@pytest.mark.parametrize("group_rows", [1, 5, 1000])
def test_screen_gives_the_fp32_argmax(weight: torch.Tensor, monkeypatch: pytest.MonkeyPatch,
                                      group_rows: int) -> None:
    monkeypatch.setattr(logit_screen, "SCREEN_GROUP_BYTES", group_rows * 2 * weight.shape[0])
    hidden = torch.randn(23, 64, generator=torch.Generator().manual_seed(1)) * 4
    hidden[4] = weight[77] * 50  # a clear leader
    hidden[9] = 0.0  # every logit 0: the first token
    tokens = LogitScreen(weight).argmax(hidden)
    assert torch.equal(tokens, ops.linear(hidden, weight).max(dim=-1).indices)
    assert tokens[4] == 77 and tokens[9] == 0


@needs_bf16_gemm
def test_non_finite_rows_take_the_full_logits(weight: torch.Tensor) -> None:
    hidden = torch.randn(6, 64, generator=torch.Generator().manual_seed(2))
    hidden[2, 5] = float("nan")
    hidden[3, 0] = float("inf")
    tokens = LogitScreen(weight).argmax(hidden)
    assert torch.equal(tokens, ops.linear(hidden, weight).max(dim=-1).indices)


def test_usable_only_with_the_compiled_kernels_on_fp32_cpu_weights(weight: torch.Tensor) -> None:
    assert LogitScreen.usable(weight) == ops.native_bf16()
    assert not LogitScreen.usable(weight.bfloat16())
    assert not LogitScreen.usable(weight, ops.REFERENCE)
