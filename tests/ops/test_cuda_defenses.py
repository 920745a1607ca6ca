"""The CUDA path defends itself (issue 24): bad indices inside device tensors are skipped by the
kernels and raised by the wrappers (DeviceIndexError, from the error flag: no sync per call, and
the CUDA context stays usable), query_start_loc[0] > 0 writes no row outside a sequence, strided
index tensors read right, launches past 65,535 sequences or copy pairs loop, and head-256 prefill
runs with the smaller tile a 99 KiB device gets. Runs when a GPU is lent (gpu-marked)."""

from __future__ import annotations

import pytest
import torch

import ops
import ops.attention
from ops.checks_cuda import OPTIN_SMEM_BYTES, prefill_rows_per_warp
from ops.reference.kv_quant import quantize_rows
from tests.ops.paged_inputs import TOLERANCE, make_paged, make_prefill
from tests.ops.test_prefill_attention import mixed_batch

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
pytestmark = [pytest.mark.gpu, needs_cuda]


@pytest.fixture(autouse=True)
def clean_flag() -> None:
    ops.raise_device_errors(sync=True)  # nothing left over from an earlier test


def expect_flag(match: str) -> None:
    with pytest.raises(ops.DeviceIndexError, match=match):
        ops.raise_device_errors(sync=True)
    ops.raise_device_errors(sync=True)  # read once, then cleared


def decode_args(lens: list[int], seed: int = 1) -> list[torch.Tensor]:
    return list(make_paged(lens, (8, 2), 64, 16, torch.float16, "cuda", seed))


def test_bad_block_table_entry_in_decode_is_skipped_and_raised() -> None:
    args = decode_args([40, 700, 33])
    tables = args[3].clone()
    tables[1, 2] = args[1].shape[0] + 1000  # past the pool, in the long sequence's first partition
    good = ops.reference.paged_attention(*args, 0.125)
    out = ops.paged_attention(*args[:3], tables, args[4], 0.125)
    expect_flag("block-table entry")
    torch.testing.assert_close(out[[0, 2]].float(), good[[0, 2]].float(), atol=1e-3, rtol=1e-3)  # others intact
    torch.testing.assert_close(ops.paged_attention(*args, 0.125).float(), good.float(), atol=1e-3, rtol=1e-3)


def test_context_longer_than_the_table_is_raised_not_clamped() -> None:
    args = decode_args([40, 20])
    lens = args[4].clone()
    lens[0] = args[3].shape[1] * 16 + 1
    out = ops.paged_attention(*args[:4], lens, 0.125)
    expect_flag("context length")
    assert torch.isfinite(out).all() and not out[0].any()  # skipped: zeros, not a read past the table


def test_the_next_cuda_call_raises_without_an_explicit_check() -> None:
    args = decode_args([40, 20])
    tables = args[3].clone()
    tables[0, 0] = -3
    ops.paged_attention(*args[:3], tables, args[4], 0.125)
    torch.cuda.synchronize()  # the engine syncs once a step when it reads the sampled tokens
    with pytest.raises(ops.DeviceIndexError, match="block-table entry"):
        ops.paged_attention(*args, 0.125)
    ops.paged_attention(*args, 0.125)  # cleared by the raise


@pytest.mark.parametrize("dtype", [torch.float16, torch.int8], ids=str)
def test_slot_past_the_cache_is_skipped_in_both_cache_writes(dtype: torch.dtype) -> None:
    num_blocks, block_size, kv_heads, head = 4, 16, 2, 64
    row = head + 2 if dtype == torch.int8 else head
    key_cache = torch.zeros(num_blocks, kv_heads, block_size, row, dtype=dtype, device="cuda")
    value_cache = key_cache.clone()
    key, value = (torch.randn(3, kv_heads, head, device="cuda").half() for _ in range(2))
    slots = torch.tensor([5, num_blocks * block_size, 7], device="cuda")
    ops.reshape_and_cache(key, value, key_cache, value_cache, slots)
    expect_flag("cache slot")
    want_k, want_v = torch.zeros_like(key_cache), torch.zeros_like(value_cache)
    ops.reference.reshape_and_cache(key, value, want_k, want_v, torch.tensor([5, -1, 7], device="cuda"))
    assert torch.equal(key_cache, want_k) and torch.equal(value_cache, want_v)

    query = torch.randn(3, 4, head, device="cuda").half()
    cos_sin = torch.randn(100, head, device="cuda")
    positions = torch.tensor([1, 2, 3], device="cuda")
    ops.rotary_embedding_and_cache(positions, query, key, value, cos_sin, key_cache, value_cache,
                                   torch.tensor([9, -1, 10_000], device="cuda"))
    expect_flag("cache slot")


def test_prefill_flags_bad_entries_ranges_and_lengths() -> None:
    args = list(make_prefill([(20, 100), (5, 40)], (8, 2), 64, 16, torch.float16, "cuda", 3))
    tables = args[3].clone()
    tables[0, 1] = 1 << 20
    ops.paged_prefill_attention(*args[:3], tables, *args[4:], 0.125)
    expect_flag("block-table entry")
    lens = args[5].clone()
    lens[1] = 4  # shorter than its 5 query tokens
    ops.paged_prefill_attention(*args[:5], lens, 0.125)
    expect_flag("context length")
    starts = args[4].clone()
    starts[1] = 30  # past the second sequence's end: a decreasing range
    ops.paged_prefill_attention(*args[:4], starts, args[5], 0.125)
    expect_flag("query_start_loc")


def test_prefill_with_rows_before_the_first_sequence() -> None:
    """query_start_loc[0] > 0: the rows before it belong to no sequence and stay as they were."""
    query, key_cache, value_cache, tables, starts, lens = make_prefill(
        [(37, 37), (16, 80)], (9, 3), 64, 16, torch.float32, "cuda", 4)
    shifted = torch.cat((torch.randn(45, *query.shape[1:], device="cuda"), query))
    starts = starts + 45
    out = torch.full_like(shifted, 7.0)
    ops.paged_prefill_attention(shifted, key_cache, value_cache, tables, starts, lens, 0.125, out=out)
    ops.raise_device_errors(sync=True)
    want = ops.reference.paged_prefill_attention(shifted, key_cache, value_cache, tables, starts, lens, 0.125)
    assert bool((out[:45] == 7.0).all())
    torch.testing.assert_close(out[45:], want[45:], atol=1e-4, rtol=1e-4)


def test_strided_index_tensors_read_like_contiguous_ones() -> None:
    query, key_cache, value_cache, tables, starts, lens = make_prefill(
        mixed_batch(16), (9, 3), 64, 16, torch.float16, "cuda", 5)
    wide = torch.full((tables.shape[0], 2 * tables.shape[1]), -1, dtype=torch.int32, device="cuda")
    wide[:, ::2] = tables
    strided_tables = wide[:, ::2]
    strided_lens = torch.stack((lens, lens), dim=1)[:, 0]
    strided_starts = torch.stack((starts, starts), dim=1)[:, 1]
    assert not (strided_tables.is_contiguous() or strided_lens.is_contiguous() or strided_starts.is_contiguous())
    want = ops.reference.paged_prefill_attention(query, key_cache, value_cache, tables, starts, lens, 0.125)
    got = ops.paged_prefill_attention(query, key_cache, value_cache, strided_tables, strided_starts, strided_lens,
                                      0.125)
    torch.testing.assert_close(got.float(), want.float(), atol=1e-3, rtol=1e-3)
    one = query[starts[1:].long() - 1]  # each sequence's last token, as a decode batch
    torch.testing.assert_close(ops.paged_attention(one, key_cache, value_cache, strided_tables, strided_lens, 0.125),
                               ops.reference.paged_attention(one, key_cache, value_cache, tables, lens, 0.125),
                               atol=1e-3, rtol=1e-3)

    kv_heads, head = 3, 64
    cache = torch.zeros(8, kv_heads, 16, head, dtype=torch.float16, device="cuda")
    key, value = (torch.randn(6, kv_heads, head, device="cuda").half() for _ in range(2))
    slots = torch.stack((torch.arange(6, device="cuda") * 3, torch.zeros(6, dtype=torch.int64, device="cuda")), 1)
    got_k, got_v, want_k, want_v = (cache.clone() for _ in range(4))
    ops.reshape_and_cache(key, value, got_k, got_v, slots[:, 0])
    ops.reference.reshape_and_cache(key, value, want_k, want_v, slots[:, 0].contiguous())
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    positions = torch.stack((torch.arange(6, device="cuda"), torch.zeros(6, dtype=torch.int64, device="cuda")), 1)
    q = torch.randn(6, 6, head, device="cuda").half()
    cos_sin = torch.randn(10, head, device="cuda")
    results = []
    for fn, pos, slot in ((ops.rotary_embedding_and_cache, positions[:, 0], slots[:, 0]),
                          (ops.reference.rotary_embedding_and_cache, positions[:, 0].contiguous(),
                           slots[:, 0].contiguous())):
        qq, kk, kc, vc = q.clone(), key.clone(), cache.clone(), cache.clone()
        fn(pos, qq, kk, value, cos_sin, kc, vc, slot)
        results.append((qq, kc, vc))
    for got_t, want_t in zip(*results, strict=True):
        torch.testing.assert_close(got_t.float(), want_t.float(), atol=TOLERANCE[torch.float16],
                                   rtol=TOLERANCE[torch.float16])


def test_decode_past_65535_sequences_loops_over_launches() -> None:
    num_seqs = 70_000
    # a 700-token context: two partitions, so the split-K reduce loops over the launches too
    query, key_cache, value_cache, tables, lens = make_paged([1, 5, 17, 700], (8, 2), 64, 16, torch.float16,
                                                             "cuda", 6)
    pick = torch.arange(num_seqs, device="cuda") % 4
    big = (query[pick], key_cache, value_cache, tables[pick].contiguous(), lens[pick].contiguous())
    out = ops.paged_attention(*big, 0.125)
    ops.raise_device_errors(sync=True)
    small = ops.paged_attention(query, key_cache, value_cache, tables, lens, 0.125)
    torch.testing.assert_close(small.float(), ops.reference.paged_attention(
        query, key_cache, value_cache, tables, lens, 0.125).float(), atol=1e-3, rtol=1e-3)
    assert torch.equal(out, small[pick])  # rows past 65,535 included, bit for bit


def test_copy_blocks_past_65535_pairs_loops_over_launches() -> None:
    pairs = 70_000
    caches = [torch.randn(2 * pairs + 1, 1, 8, 64, device="cuda").half() for _ in range(4)]
    mapping = torch.stack((torch.arange(pairs), torch.arange(pairs) + pairs + 1), dim=1)
    want = [c.clone() for c in caches]
    for cache in want:
        cache[pairs + 1:] = cache[:pairs]
    ops.copy_blocks(caches[:2], caches[2:], mapping)
    torch.cuda.synchronize()
    assert all(torch.equal(got, ref) for got, ref in zip(caches, want, strict=True))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.int8], ids=str)
def test_head_256_prefill_on_a_99_kib_device_takes_the_smaller_tile(monkeypatch: pytest.MonkeyPatch,
                                                                     dtype: torch.dtype) -> None:
    """The tile an sm_86/89/120 card gets (101,376 bytes opt-in), run here: rows 16 a CTA."""
    limit = OPTIN_SMEM_BYTES[(8, 6)]
    assert prefill_rows_per_warp(256, limit) == 4
    monkeypatch.setattr(ops.attention, "optin_smem_bytes", lambda device: limit)
    query, key_cache, value_cache, tables, starts, lens = make_prefill(
        [*mixed_batch(16), (700, 700)], (16, 4), 256, 16, torch.float32, "cpu", 7)
    if dtype == torch.int8:
        key_cache, value_cache = quantize_rows(key_cache), quantize_rows(value_cache)
        qdtype = torch.bfloat16
    else:
        key_cache, value_cache, qdtype = key_cache.to(dtype), value_cache.to(dtype), dtype
    args = [t.cuda() for t in (query.to(qdtype), key_cache, value_cache, tables, starts, lens)]
    got = ops.paged_prefill_attention(*args, 0.0625)
    ops.raise_device_errors(sync=True)
    want = ops.reference.paged_prefill_attention(*args, 0.0625)
    tol = TOLERANCE[qdtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_rope_position_outside_the_table_is_raised() -> None:
    """The CPU kernel raises on it; the CUDA one leaves the token unrotated and says so."""
    query, key, value = (torch.randn(2, 2, 64, device="cuda") for _ in range(3))
    empty = torch.empty(0, 2, 16, 64, device="cuda")
    ops.rotary_embedding_and_cache(torch.tensor([0, 10], device="cuda"), query, key, value,
                                   torch.randn(10, 64, device="cuda"), empty, empty,
                                   torch.zeros(2, dtype=torch.int64, device="cuda"))
    expect_flag("RoPE position")
