"""What the scheduler asks the block manager before it runs or swaps in a forked group (issue
43): the blocks one more token for each sequence really takes, copy-on-write counted once per
sharer but the last, and a swap-in rule a group that ran before can always meet again."""

from __future__ import annotations

import pytest

from engine.kv.block_manager import BlockManager


def _forked(manager: BlockManager, prompt_len: int, n: int) -> list[int]:
    """Sequence 0 with a prompt of `prompt_len` tokens, forked into n sharing every block."""
    manager.allocate(0, [1] * prompt_len)
    for child in range(1, n):
        manager.fork(0, child)
    return list(range(n))


def test_samples_sharing_a_partial_last_block_need_one_copy_fewer_than_they_are() -> None:
    manager = BlockManager(8, 8)
    ids = _forked(manager, 17, 3)  # blocks of 8, 8 and 1 token, each held by 3
    assert manager.num_group_append_blocks(ids) == 2  # two copies; the third writes in place
    assert manager.num_group_append_blocks(ids[:2]) == 2  # a third holder stays: both copy
    copies = [manager.append_slot(seq_id, 5) for seq_id in ids]
    assert sum(copy is not None for copy in copies) == 2 and manager.num_used_blocks == 3 + 2
    manager.check_invariants()


def test_full_last_blocks_need_a_block_each() -> None:
    manager = BlockManager(8, 8)
    ids = _forked(manager, 16, 2)
    assert manager.num_group_append_blocks(ids) == 2


def test_exactly_enough_free_blocks_lets_the_group_run() -> None:
    manager = BlockManager(4, 8)
    ids = _forked(manager, 17, 2)  # 3 blocks used, 1 free
    assert manager.can_append_slots(ids)  # 1 copy, not 2
    manager.allocate(9, [2])
    assert not manager.can_append_slots(ids)


def test_a_swapped_group_that_filled_the_pool_fits_the_empty_pool_again() -> None:
    manager = BlockManager(4, 8, 3)
    ids = _forked(manager, 17, 2)
    manager.swap_out(ids)
    # 3 blocks + 1 to grow per sample = 5 could never fit 4: ask for the next token's 1 copy
    assert manager.can_swap_in(ids)
    manager.allocate(9, [2])
    assert not manager.can_swap_in(ids)  # 3 free < 3 + 1
    manager.free(9)
    manager.swap_in(ids)
    assert sum(manager.append_slot(seq_id, 5) is not None for seq_id in ids) == 1
    assert manager.num_free_blocks == 0
    manager.check_invariants()


def test_swap_in_keeps_its_headroom_where_the_pool_can_hold_it() -> None:
    manager = BlockManager(6, 8, 3)
    ids = _forked(manager, 17, 2)
    manager.swap_out(ids)
    manager.allocate(9, [2])  # 5 free: 3 blocks + 1 copy fit, 3 + 2 headroom do too
    assert manager.can_swap_in(ids)
    manager.allocate(10, [3])  # 4 free: only without the headroom, which 6 blocks can hold
    assert not manager.can_swap_in(ids)


def test_allocate_sharing_takes_the_donors_full_blocks_and_fresh_ones_for_the_rest() -> None:
    manager = BlockManager(8, 4)
    manager.allocate(0, [1] * 9 + [2])  # 3 blocks: 4, 4, 2
    manager.allocate_sharing(1, [1] * 9 + [3], 0, 2)
    assert manager.block_table(1)[:2] == manager.block_table(0)[:2]
    assert manager.block_table(1)[2] != manager.block_table(0)[2] and manager.num_used_blocks == 4
    manager.check_invariants()
    manager.free(0)
    manager.free(1)
    assert manager.num_used_blocks == 0
    manager.check_invariants()
    manager.allocate(0, [1] * 10)
    with pytest.raises(ValueError, match="same tokens"):
        manager.allocate_sharing(1, [1] * 7 + [5, 5], 0, 2)
    with pytest.raises(ValueError, match="cannot share"):
        manager.allocate_sharing(1, [1] * 8, 0, 2)  # nothing of its own left to compute
