"""reshape_and_cache, copy_blocks and swap_blocks: compiled kernels against the torch reference."""

from __future__ import annotations

import pytest
import torch

import ops

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def caches(
    num_blocks: int, kv_heads: int, block_size: int, head: int, dtype: torch.dtype, device: str
) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (num_blocks, kv_heads, block_size, head)
    return torch.randn(shape).to(device=device, dtype=dtype), torch.randn(shape).to(device=device, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_reshape_and_cache_matches_reference(dtype: torch.dtype, block_size: int) -> None:
    torch.manual_seed(block_size)
    num_blocks, kv_heads, head, tokens = 12, 3, 64, 40
    key_cache, value_cache = caches(num_blocks, kv_heads, block_size, head, dtype, "cpu")
    # key/value as views into a fused qkv projection: strided over tokens, as the model makes them.
    qkv = torch.randn(tokens, 3 * kv_heads, head).to(dtype)
    key, value = qkv[:, kv_heads : 2 * kv_heads], qkv[:, 2 * kv_heads :]
    slots = torch.randperm(num_blocks * block_size)[:tokens]
    slots[::7] = -1  # padding tokens are skipped
    expected = [key_cache.clone(), value_cache.clone()]
    ops.reference.reshape_and_cache(key, value, expected[0], expected[1], slots)
    ops.reshape_and_cache(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, expected[0]) and torch.equal(value_cache, expected[1])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_copy_blocks_every_layer(dtype: torch.dtype) -> None:
    layers = [caches(10, 2, 16, 64, dtype, "cpu") for _ in range(3)]
    key_caches, value_caches = [k for k, _ in layers], [v for _, v in layers]
    expected_k, expected_v = [k.clone() for k in key_caches], [v.clone() for v in value_caches]
    mapping = torch.tensor([[0, 5], [3, 9], [3, 1]])
    ops.reference.copy_blocks(expected_k, expected_v, mapping)
    ops.copy_blocks(key_caches, value_caches, mapping)
    for got, want in zip(key_caches + value_caches, expected_k + expected_v, strict=True):
        assert torch.equal(got, want)
    assert torch.equal(key_caches[2][1], key_caches[2][3])


def test_swap_blocks_out_and_back_on_cpu() -> None:
    device_pool, host_pool = caches(8, 2, 16, 64, torch.float32, "cpu")[0], torch.zeros(4, 2, 16, 64)
    ops.swap_blocks(device_pool, host_pool, torch.tensor([[6, 0], [2, 3]]))
    assert torch.equal(host_pool[0], device_pool[6]) and torch.equal(host_pool[3], device_pool[2])
    fresh = torch.zeros_like(device_pool)
    ops.swap_blocks(host_pool, fresh, torch.tensor([[0, 1], [3, 7]]))
    assert torch.equal(fresh[1], device_pool[6]) and torch.equal(fresh[7], device_pool[2])
    assert fresh[0].abs().sum() == 0


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_cache_ops_match_reference(dtype: torch.dtype) -> None:
    key_cache, value_cache = caches(20, 4, 16, 128, dtype, "cuda")
    key, value = (torch.randn(50, 4, 128, device="cuda").to(dtype) for _ in range(2))
    slots = torch.randperm(20 * 16, device="cuda")[:50]
    slots[::5] = -1
    expected = [key_cache.clone(), value_cache.clone()]
    ops.reference.reshape_and_cache(key, value, expected[0], expected[1], slots)
    ops.reshape_and_cache(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, expected[0]) and torch.equal(value_cache, expected[1])

    mapping = torch.tensor([[0, 5], [3, 9]])
    ops.reference.copy_blocks([expected[0]], [expected[1]], mapping)
    ops.copy_blocks([key_cache], [value_cache], mapping)
    assert torch.equal(key_cache, expected[0]) and torch.equal(value_cache, expected[1])

    host = torch.zeros((6, 4, 16, 128), dtype=dtype).pin_memory()
    ops.swap_blocks(key_cache, host, torch.tensor([[9, 0], [3, 5]]))
    torch.cuda.synchronize()
    assert torch.equal(host[0], key_cache[9].cpu()) and torch.equal(host[5], key_cache[3].cpu())
    back = torch.zeros_like(key_cache)
    ops.swap_blocks(host, back, torch.tensor([[5, 2]]))
    torch.cuda.synchronize()
    assert torch.equal(back[2], key_cache[3])
