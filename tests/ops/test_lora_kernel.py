"""The multi-LoRA row kernel (`ops.lora.lora_rows`, csrc/cpu/lora.cpp) against the torch reference
over a grid of shapes, and its batch invariance: each row's bits are the same computed alone, in
the batch, or beside other rows and slots."""

from __future__ import annotations

import itertools

import pytest
import torch

from ops.lora import kernel_applies, lora_rows
from ops.policy import REFERENCE
from ops.reference import lora as reference

ROWS = [1, 2, 5, 17, 40]
K_SIZES = [64, 100, 576, 1536]
RANKS = [1, 7, 16, 64]
SLOTS = 4


def inputs(m: int, k: int, n: int, rank: int, seed: int) -> tuple[torch.Tensor, ...]:
    """out, x, a, b, slot_of_row: about one row in four without an adapter, x rows strided."""
    gen = torch.Generator().manual_seed(seed)
    out = torch.randn(m, n + 5, generator=gen)[:, 2 : 2 + n]
    x = torch.randn(m, k + 3, generator=gen)[:, :k]
    a = torch.randn(SLOTS, rank, k, generator=gen) * 0.1
    b = torch.randn(SLOTS, n, rank, generator=gen) * 0.1
    slot = torch.randint(-1, SLOTS, (m,), generator=gen)
    return out, x, a, b, slot


@pytest.mark.parametrize(("m", "k", "rank"), list(itertools.product(ROWS, K_SIZES, RANKS)))
def test_matches_reference_and_rows_alone(m: int, k: int, rank: int) -> None:
    n = 3 * k // 2 + 1
    out, x, a, b, slot = inputs(m, k, n, rank, seed=m * 7919 + k * 31 + rank)
    assert kernel_applies(out, x, a)
    got = out.clone()
    assert lora_rows(got, x, a, b, slot) is got
    want = reference.lora_rows(out.clone(), x, a, b, slot)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(got[slot < 0], out[slot < 0])  # rows without a slot are untouched
    for row in range(m):
        alone = out[row : row + 1].clone()
        lora_rows(alone, x[row : row + 1], a, b, slot[row : row + 1])
        assert torch.equal(alone[0], got[row]), f"row {row} differs alone"


def test_row_bits_independent_of_neighbours_and_slot_columns() -> None:
    """The same row beside other rows and other slots' weights, and as a column slice of a wider
    output (the q/k/v parts of one fused linear), gives the same bits."""
    out, x, a, b, slot = inputs(40, 576, 192, 16, seed=3)
    slot[0] = 2
    first = out[:1].clone()
    lora_rows(first, x[:1], a, b, slot[:1])
    shuffled = torch.cat([x[1:], x[:1]])
    wide = torch.cat([out[1:], out[:1]])
    wide_out = torch.zeros(40, 400)
    wide_out[:, 100:292] = wide
    lora_rows(wide_out[:, 100:292], shuffled, a, b, torch.cat([slot[1:], slot[:1]]))
    assert torch.equal(wide_out[-1, 100:292], first[0])
    assert torch.equal(wide_out[:, :100], torch.zeros(40, 100))
    assert torch.equal(wide_out[:, 292:], torch.zeros(40, 108))


def test_no_slot_and_empty() -> None:
    out, x, a, b, _ = inputs(6, 64, 32, 8, seed=4)
    before = out.clone()
    lora_rows(out, x, a, b, torch.full((6,), -1, dtype=torch.int64))
    assert torch.equal(out, before)
    empty = torch.empty(0, 32)
    lora_rows(empty, x[:0], a, b, torch.empty(0, dtype=torch.int64))


def test_bad_slot_and_shapes_rejected() -> None:
    out, x, a, b, slot = inputs(3, 64, 32, 8, seed=5)
    with pytest.raises(RuntimeError, match="out of range"):
        lora_rows(out, x, a, b, torch.tensor([0, SLOTS, 1]))
    with pytest.raises(ValueError, match="disagree on the rows"):
        lora_rows(out, x, a, b, slot[:2])
    with pytest.raises(RuntimeError, match="shapes disagree"):
        lora_rows(out, x, a, b[:, :, :4], slot)


def test_reference_backend_and_other_dtypes_take_the_torch_path() -> None:
    out, x, a, b, slot = inputs(5, 64, 32, 8, seed=6)
    assert not kernel_applies(out.bfloat16(), x.bfloat16(), a.bfloat16())
    assert not kernel_applies(out, x, a, REFERENCE)
    got = lora_rows(out.clone(), x, a, b, slot, policy=REFERENCE)
    assert torch.equal(got, reference.lora_rows(out.clone(), x, a, b, slot))


@pytest.mark.parametrize("rank", [9, 20])
def test_a_sum_the_same_in_every_lane_group(rank: int) -> None:
    """An output column (or rank row) summed eight at a time or on its own gives the same bits: the
    columns of b shifted by one put each column in the other kind of group."""
    out, x, a, b, slot = inputs(6, 100, 17, rank, seed=7)
    slot[:] = torch.tensor([0, 1, 2, 3, 0, 1])
    whole = out.clone()
    lora_rows(whole, x, a, b, slot)
    shifted = out[:, 1:].clone()
    lora_rows(shifted, x, a, b[:, 1:], slot)
    assert torch.equal(shifted, whole[:, 1:])
    # b the identity: out[:, r] is exactly t[r] = x . a[s][r], each rank row's own sum
    t_all = torch.zeros(6, rank)
    lora_rows(t_all, x, a, torch.eye(rank).expand(4, rank, rank).contiguous(), slot)
    t_shifted = torch.zeros(6, rank - 1)
    lora_rows(t_shifted, x, a[:, 1:], torch.eye(rank - 1).expand(4, rank - 1, rank - 1).contiguous(), slot)
    assert torch.equal(t_shifted, t_all[:, 1:])
