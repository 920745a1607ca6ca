"""`pagedserve plan --tensor-parallel-size`: one rank's KV heads (split, or one replicated head)
and weights share decide the group's block count; a split that fits no head layout is refused."""

from __future__ import annotations

import pytest

from pagedserve.plan.model_shape import KVShape, PlanError
from pagedserve.plan.planner import plan_capacity, rank_shape

SHAPE = KVShape(num_layers=80, num_kv_heads=8, head_dim=128, dtype_bytes=2)
BUDGET = {"gpu_memory": 80 << 30, "utilization": 0.9, "workspace": 0, "block_size": 16, "avg_tokens": 512,
          "max_model_len": 8192}


def test_each_rank_holds_its_share_of_the_kv_heads() -> None:
    assert rank_shape(SHAPE, 4).num_kv_heads == 2
    assert rank_shape(SHAPE, 16).num_kv_heads == 1  # replicated past the head count
    one = plan_capacity(SHAPE, weights=0, **BUDGET)
    four = plan_capacity(SHAPE, weights=0, tensor_parallel_size=4, **BUDGET)
    assert four.bytes_per_token * 4 == one.bytes_per_token
    assert four.num_blocks == one.pool_bytes // four.block_bytes >= 4 * one.num_blocks
    assert four.tensor_parallel_size == 4


def test_weights_split_over_the_ranks() -> None:
    plan = plan_capacity(SHAPE, weights=140 << 30, tensor_parallel_size=4, **BUDGET)
    assert plan.pool_bytes == int(0.9 * (80 << 30)) - (35 << 30)


def test_a_split_that_fits_no_head_layout_is_refused() -> None:
    with pytest.raises(PlanError, match="neither divides the 8 KV heads"):
        rank_shape(SHAPE, 3)
