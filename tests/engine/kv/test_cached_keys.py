"""`BlockManager.cached_keys`: the prefix-cache keys a routed engine announces, most recently
used first, matching what gateways compute with `common.block_hash.prefix_keys`."""

from __future__ import annotations

from common.block_hash import prefix_keys
from engine.kv.block_manager import BlockManager

BS = 4


def make(num_blocks: int = 16) -> BlockManager:
    return BlockManager(num_blocks, BS, 0, watermark=0.0, enable_prefix_caching=True)


def run(manager: BlockManager, seq_id: int, token_ids: list[int]) -> None:
    manager.allocate(seq_id, token_ids)
    manager.mark_computed(seq_id, len(token_ids))


def test_empty_pool_and_zero_limit() -> None:
    manager = make()
    assert manager.cached_keys(10) == []
    run(manager, 0, list(range(9)))
    assert manager.cached_keys(0) == []


def test_in_use_keys_are_the_gateways_prefix_keys() -> None:
    manager = make()
    prompt = list(range(13))
    run(manager, 0, prompt)
    # 3 full blocks cached; a gateway looks up the first (13 - 1) // 4 = 3
    assert set(manager.cached_keys(100)) == set(prefix_keys(prompt, BS))


def test_in_use_before_free_and_latest_freed_first() -> None:
    manager = make()
    a, b, c = list(range(100, 105)), list(range(200, 205)), list(range(300, 305))
    run(manager, 0, a)
    run(manager, 1, b)
    run(manager, 2, c)
    manager.free(0)
    manager.free(1)
    keys = manager.cached_keys(100)
    assert keys == [prefix_keys(c, BS)[0], prefix_keys(b, BS)[0], prefix_keys(a, BS)[0]]
    assert manager.cached_keys(2) == keys[:2]


def test_evicted_keys_disappear() -> None:
    manager = make(num_blocks=2)
    first = list(range(5))
    run(manager, 0, first)
    manager.free(0)
    run(manager, 1, list(range(50, 58)))  # needs both blocks: evicts the cached one
    assert prefix_keys(first, BS)[0] not in manager.cached_keys(100)
