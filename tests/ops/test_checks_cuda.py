"""The CUDA path's host-side checks, run on the CPU: the shared-memory need of a prefill CTA (the
smaller tile where the device cannot grant the default one, a refusal where it cannot grant
either), the cache geometries the kernels take (int8 caches included), block-id ranges of host
mappings, one block geometry for every layer, and how the kernels' error flag reads. The same
checks guard the CUDA launches (`ops/attention.py`, `ops/cache.py`); tests/ops/test_cuda_*.py run
the kernels when a GPU is lent."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import pytest
import torch

import ops
from ops.checks_cuda import (
    OPTIN_SMEM_BYTES,
    check_cuda_cache,
    check_mapping_range,
    check_same_geometry,
    prefill_rows_per_warp,
    prefill_smem_bytes,
)
from ops.device_errors import ERROR_KINDS, describe, take


def test_prefill_shared_memory_matches_the_kernel_layout() -> None:
    assert prefill_smem_bytes(256) == 103_424  # over the 99 KiB opt-in limit of sm_86/89/120
    assert prefill_smem_bytes(128) == 4 * (32 * 128 + 128 * 33 + 32 * 128 + 4 * 8 * 32)
    assert prefill_smem_bytes(256, 4) == 4 * (16 * 256 + 256 * 33 + 32 * 256 + 4 * 4 * 32) == 84_992


@pytest.mark.parametrize(("capability", "head", "rows"), [
    ((8, 6), 256, 4), ((8, 9), 256, 4), ((12, 0), 256, 4), ((8, 6), 128, 8), ((8, 0), 256, 8), ((9, 0), 256, 8),
    ((7, 5), 128, 8),
])
def test_prefill_takes_the_smaller_tile_where_the_default_does_not_fit(
        capability: tuple[int, int], head: int, rows: int) -> None:
    assert prefill_rows_per_warp(head, OPTIN_SMEM_BYTES[capability]) == rows


def test_prefill_is_refused_where_no_tile_fits() -> None:
    with pytest.raises(ValueError, match=r"head size 256 needs 84992 bytes .* allows 65536"):
        prefill_rows_per_warp(256, OPTIN_SMEM_BYTES[(7, 5)], "an sm_75 card")
    with pytest.raises(ValueError, match=r"head size 128 needs 53760 bytes .* allows 49152"):
        prefill_rows_per_warp(128, 49_152)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.int8], ids=str)
def test_cuda_cache_geometries_include_int8_rows(dtype: torch.dtype) -> None:
    row = 130 if dtype == torch.int8 else 128  # int8 rows carry their fp16 scale
    check_cuda_cache("key_cache", torch.zeros(4, 2, 16, row, dtype=dtype))
    with pytest.raises(ValueError, match="CUDA head size must be one of"):
        check_cuda_cache("key_cache", torch.zeros(4, 2, 16, row + 2, dtype=dtype))
    with pytest.raises(ValueError, match="CUDA block size must be one of"):
        check_cuda_cache("key_cache", torch.zeros(4, 2, 12, row, dtype=dtype))


def test_error_flag_bytes_name_what_the_kernels_skipped() -> None:
    """The byte order is csrc/ops.h's ErrorKind; reading the flag clears it."""
    assert describe(b"\0\0\0\0") == []
    assert describe(b"\1\0\1\0") == [ERROR_KINDS[0], ERROR_KINDS[2]]
    assert "block-table entry" in ERROR_KINDS[0] and "query_start_loc" in ERROR_KINDS[3]
    flag = ctypes.c_uint64(int.from_bytes(b"\0\1\0\1\1\0\0\0", "little"))
    assert describe(take(flag)) == [ERROR_KINDS[1], ERROR_KINDS[3], ERROR_KINDS[4]]
    assert flag.value == 0


def test_host_mappings_out_of_range_are_refused_before_any_copy() -> None:
    cache = torch.zeros(4, 2, 8, 16)
    check_mapping_range(torch.tensor([[0, 3], [3, 0]]), 4, 4, "copy_blocks")
    for bad in ([[4, 0]], [[0, -1]], [[-2, 1]]):
        with pytest.raises(ValueError, match="block ids must lie in"):
            ops.copy_blocks([cache], [cache.clone()], torch.tensor(bad))
    host = torch.zeros(2, 2, 8, 16)
    with pytest.raises(ValueError, match=r"\[0, 4\) \(src\) and \[0, 2\) \(dst\)"):
        ops.swap_blocks(cache, host, torch.tensor([[1, 2]]))
    ops.swap_blocks(cache, host, torch.tensor([[3, 1]]))  # in range: done


def test_layers_of_another_geometry_are_refused() -> None:
    check_same_geometry([torch.zeros(4, 2, 8, 16), torch.zeros(4, 2, 8, 16)])
    with pytest.raises(ValueError, match="layer 1 cache"):
        check_same_geometry([torch.zeros(4, 2, 8, 16), torch.zeros(4, 2, 16, 16)])


def test_error_kinds_follow_the_kernels_enum() -> None:
    """ERROR_KINDS is read by byte index: its order must be csrc/ops.h's ErrorKind."""
    header = (Path(__file__).parents[2] / "csrc" / "ops.h").read_text()
    enum = re.findall(r"kBad(\w+) = (\d+),", header)
    assert [int(index) for _, index in enum] == list(range(len(ERROR_KINDS)))
    words = {"BlockEntry": "block-table entry", "ContextLen": "context length", "Slot": "cache slot",
             "QueryStart": "query_start_loc", "Position": "RoPE position"}
    assert [words[name] in ERROR_KINDS[int(index)] for name, index in enum] == [True] * len(enum)
