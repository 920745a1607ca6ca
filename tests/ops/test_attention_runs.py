"""Decode attention over runs of rows (issue 25): a speculative row's 1 + k positions reach the
decode kernel as consecutive rows of one sequence (context lengths L + 1 .. L + 1 + k, the same
block table), and the CPU kernel attends such a run in one task, reading each K/V row once. Each
row's output must be bit for bit what a call with that row alone gives (the order of every sum is
plain decoding's), over float and int8 caches, GQA shapes, block sizes, runs crossing block
boundaries, runs longer than the kernel's run cap, and rows that look like a run but are not."""

from __future__ import annotations

import pytest
import torch

import ops
from ops.reference.kv_quant import quantize_rows
from tests.ops.paged_inputs import HEAD_PAIRS, TOLERANCE, make_paged

BLOCK_SIZES = [8, 16]


def verify_batch(block_size: int) -> list[tuple[int, int]]:
    """(rows, first context length) of each sequence: runs of 1 + k rows, plain decodes (1 row) among
    them, a run that crosses two block boundaries, one longer than the kernel's cap of 16 rows."""
    return [(5, 40), (1, 17), (9, 3 * block_size - 4), (2, block_size), (1, 1), (20, 2 * block_size + 3),
            (4, block_size - 1)]


def run_inputs(block_size: int, heads: tuple[int, int], head_size: int, cache: str, dtype: torch.dtype,
               seed: int) -> tuple[torch.Tensor, ...]:
    """Query rows, caches, a block-table row per query row (a sequence's rows repeat its table) and
    the rows' context lengths."""
    runs = verify_batch(block_size)
    query, key_cache, value_cache, tables, _ = make_paged([start + n - 1 for n, start in runs], heads, head_size,
                                                          block_size, torch.float32, "cpu", seed)
    seq_of_row = torch.cat([torch.full((n,), s) for s, (n, _) in enumerate(runs)])
    lens = torch.tensor([start + j for n, start in runs for j in range(n)], dtype=torch.int32)
    gen = torch.Generator().manual_seed(seed + 1)
    query = torch.randn(len(lens), heads[0], head_size, generator=gen).to(dtype)
    if cache == "int8":
        key_cache, value_cache = quantize_rows(key_cache), quantize_rows(value_cache)
    else:
        key_cache, value_cache = key_cache.to(dtype), value_cache.to(dtype)
    return query, key_cache, value_cache, tables[seq_of_row].contiguous(), lens


CASES = [(64, torch.float32, "float"), (128, torch.float32, "float"), (64, torch.bfloat16, "float"),
         (128, torch.float16, "float"), (64, torch.float32, "int8"), (128, torch.bfloat16, "int8")]


@pytest.mark.parametrize(("head_size", "dtype", "cache"), CASES, ids=str)
def test_a_run_of_rows_equals_each_row_alone_bit_for_bit(head_size: int, dtype: torch.dtype, cache: str) -> None:
    for block_size in BLOCK_SIZES:
        for heads in HEAD_PAIRS:
            query, key_cache, value_cache, tables, lens = run_inputs(block_size, heads, head_size, cache, dtype,
                                                                     head_size + block_size)
            scale = head_size**-0.5
            together = ops.paged_attention(query, key_cache, value_cache, tables, lens, scale)
            alone = torch.cat([ops.paged_attention(query[i : i + 1], key_cache, value_cache, tables[i : i + 1],
                                                   lens[i : i + 1], scale) for i in range(len(lens))])
            assert torch.isfinite(together).all()
            assert torch.equal(together, alone), (block_size, heads)
            if cache == "float" and heads == (9, 3):  # the grid against the reference: tests/ops/test_attention.py
                tol = TOLERANCE[dtype]
                torch.testing.assert_close(together.float(), ops.reference.paged_attention(
                    query, key_cache, value_cache, tables, lens, scale).float(), atol=tol, rtol=tol)


def test_consecutive_lengths_over_different_blocks_are_not_a_run() -> None:
    """Two sequences whose lengths happen to be L and L + 1: each row reads its own blocks."""
    query, key_cache, value_cache, tables, _ = make_paged([30, 31, 32], (9, 3), 64, 8, torch.float32, "cpu", 7)
    lens = torch.tensor([30, 31, 32], dtype=torch.int32)
    scale = 0.125
    together = ops.paged_attention(query, key_cache, value_cache, tables, lens, scale)
    torch.testing.assert_close(together, ops.reference.paged_attention(query, key_cache, value_cache, tables, lens,
                                                                       scale), atol=1e-4, rtol=1e-4)
    alone = torch.cat([ops.paged_attention(query[i : i + 1], key_cache, value_cache, tables[i : i + 1],
                                           lens[i : i + 1], scale) for i in range(3)])
    assert torch.equal(together, alone)
