"""Host-side checks for the CUDA kernels, where the CPU kernels check inside (and raise).

On a GPU an index past a tensor is silent corruption, or a sticky illegal-address error that
kills the CUDA context, so what costs nothing on the host is checked before launch: block
mappings (host tensors), launch grids (gridDim.y/z stop at 65,535), a shared-memory need the
device cannot grant (the prefill kernel at head size 256 needs 103,424 bytes per CTA, past the
99 KiB opt-in limit of sm_86/89/120), one block geometry for every layer (`copy_blocks` takes
layer 0's). Checks that would need a device sync (block-table entries, context lengths against
the table, `query_start_loc`) stay with the CPU kernels and the reference."""

from __future__ import annotations

import functools

import torch

MAX_GRID_YZ = 65_535
# csrc/prefill_attention.cu: kRows = kWarps * kRowsPerWarp query rows, kKeys keys per tile
PREFILL_WARPS, PREFILL_ROWS_PER_WARP, PREFILL_KEYS = 4, 8, 32
# opt-in shared memory per block, by compute capability, where torch does not report it
OPTIN_SMEM_BYTES = {(7, 5): 65_536, (8, 0): 166_912, (8, 6): 101_376, (8, 7): 166_912, (8, 9): 101_376,
                    (9, 0): 232_448, (10, 0): 232_448, (12, 0): 101_376}


def prefill_smem_bytes(head_size: int) -> int:
    """Dynamic shared memory one prefill CTA needs (`Smem<HEAD_SIZE>::kBytes` in the kernel)."""
    rows = PREFILL_WARPS * PREFILL_ROWS_PER_WARP
    q, kt, v = rows * head_size, head_size * (PREFILL_KEYS + 1), PREFILL_KEYS * head_size
    p = PREFILL_WARPS * PREFILL_ROWS_PER_WARP * PREFILL_KEYS
    return 4 * (q + kt + v + p)


@functools.cache
def optin_smem_bytes(device: torch.device) -> int:
    """The most dynamic shared memory a block may opt into on this device."""
    props = torch.cuda.get_device_properties(device)
    reported = getattr(props, "shared_memory_per_block_optin", 0)
    return int(reported) or OPTIN_SMEM_BYTES.get((props.major, props.minor), 49_152)


def check_prefill_fits(head_size: int, limit: int, device_name: str = "this GPU") -> None:
    """Refuse, with the numbers, a prefill whose CTA needs more shared memory than `limit`."""
    need = prefill_smem_bytes(head_size)
    if need > limit:
        raise ValueError(
            f"prefill attention at head size {head_size} needs {need} bytes of shared memory per block; "
            f"{device_name} allows {limit}: use a device with more shared memory (A100, H100) or "
            "--attention-backend reference")


def check_grid(count: int, what: str) -> None:
    """A launch dimension the CUDA grid can hold (y and z stop at 65,535)."""
    if count > MAX_GRID_YZ:
        raise ValueError(f"{count} {what} in one launch; the CUDA kernels take at most {MAX_GRID_YZ}")


def check_mapping_range(mapping: torch.Tensor, num_src: int, num_dst: int, what: str) -> None:
    """Every (src, dst) block id of a host mapping lies in its pool (free: no device sync)."""
    if mapping.device.type != "cpu" or mapping.numel() == 0:
        return
    src, dst = mapping[:, 0], mapping[:, 1]
    if int(src.min()) < 0 or int(src.max()) >= num_src or int(dst.min()) < 0 or int(dst.max()) >= num_dst:
        raise ValueError(f"{what}: block ids must lie in [0, {num_src}) (src) and [0, {num_dst}) (dst); "
                         f"got src [{int(src.min())}, {int(src.max())}], dst [{int(dst.min())}, {int(dst.max())}]")


def check_same_geometry(caches: list[torch.Tensor]) -> None:
    """One block geometry for every layer: the CUDA `copy_blocks` takes layer 0's block bytes."""
    first = caches[0]
    for index, cache in enumerate(caches):
        if cache.shape != first.shape or cache.dtype != first.dtype:
            raise ValueError(f"layer {index} cache {tuple(cache.shape)} {cache.dtype} differs from layer 0's "
                             f"{tuple(first.shape)} {first.dtype}: copy_blocks needs one geometry")
