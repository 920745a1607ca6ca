"""The CUDA path's host-side checks, run on the CPU: the shared-memory need of a prefill CTA (and
its refusal on a device that cannot grant it), launch-grid limits, block-id ranges of host
mappings, one block geometry for every layer. The same checks guard the CUDA launches
(`ops/attention.py`, `ops/cache.py`); the gpu-marked tests run the kernels when a GPU is lent."""

from __future__ import annotations

import pytest
import torch

import ops
from ops.checks_cuda import (
    MAX_GRID_YZ,
    OPTIN_SMEM_BYTES,
    check_grid,
    check_mapping_range,
    check_prefill_fits,
    check_same_geometry,
    prefill_smem_bytes,
)


def test_prefill_shared_memory_matches_the_kernel_layout() -> None:
    assert prefill_smem_bytes(256) == 103_424  # over the 99 KiB opt-in limit of sm_86/89/120
    assert prefill_smem_bytes(128) == 4 * (32 * 128 + 128 * 33 + 32 * 128 + 4 * 8 * 32)


@pytest.mark.parametrize(("capability", "head", "fits"), [
    ((8, 6), 256, False), ((8, 9), 256, False), ((12, 0), 256, False), ((8, 6), 128, True),
    ((8, 0), 256, True), ((9, 0), 256, True),
])
def test_prefill_is_refused_where_the_device_cannot_grant_its_shared_memory(
        capability: tuple[int, int], head: int, fits: bool) -> None:
    limit = OPTIN_SMEM_BYTES[capability]
    if fits:
        check_prefill_fits(head, limit)
    else:
        with pytest.raises(ValueError, match=rf"head size {head} needs 103424 bytes .* allows {limit}"):
            check_prefill_fits(head, limit, "an sm_86 card")


def test_launch_grids_past_65535_rows_are_refused() -> None:
    check_grid(MAX_GRID_YZ, "sequences")
    with pytest.raises(ValueError, match="65536 sequences in one launch"):
        check_grid(MAX_GRID_YZ + 1, "sequences")


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
