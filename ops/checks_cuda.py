"""Host-side checks for the CUDA kernels, where the CPU kernels check inside (and raise).

On a GPU an index past a tensor is silent corruption, or a sticky illegal-address error that
kills the CUDA context, so what costs nothing on the host is checked before launch: block
mappings (host tensors), the cache geometries the kernels are compiled for, a shared-memory need
the device cannot grant, one block geometry for every layer (`copy_blocks` takes layer 0's).
What would need a device sync (block-table entries, slots, context lengths, `query_start_loc`)
the kernels check themselves: they skip the work and set the error flag of ops/device_errors.py.
Launch grids past 65,535 rows are looped over by the launchers, not refused."""

from __future__ import annotations

import functools

import torch

from ops.reference.kv_quant import head_size_of

CUDA_HEAD_SIZES = (64, 80, 96, 128, 256)
CUDA_BLOCK_SIZES = (8, 16, 32)
# csrc/prefill_attention.cu: kWarps warps of rows_per_warp query rows, kKeys keys per tile
PREFILL_WARPS, PREFILL_KEYS = 4, 32
PREFILL_ROWS_PER_WARP = 8  # the default tile (32 rows)
PREFILL_SMALL_ROWS_PER_WARP, PREFILL_SMALL_TILE_HEAD = 4, 256  # the 16-row tile, compiled for head 256
# opt-in shared memory per block, by compute capability, where torch does not report it
OPTIN_SMEM_BYTES = {(7, 5): 65_536, (8, 0): 166_912, (8, 6): 101_376, (8, 7): 166_912, (8, 9): 101_376,
                    (9, 0): 232_448, (10, 0): 232_448, (12, 0): 101_376}


def prefill_smem_bytes(head_size: int, rows_per_warp: int = PREFILL_ROWS_PER_WARP) -> int:
    """Dynamic shared memory one prefill CTA needs (`Smem<HEAD_SIZE, ROWS_PER_WARP>::kBytes`)."""
    rows = PREFILL_WARPS * rows_per_warp
    q, kt, v = rows * head_size, head_size * (PREFILL_KEYS + 1), PREFILL_KEYS * head_size
    p = PREFILL_WARPS * rows_per_warp * PREFILL_KEYS
    return 4 * (q + kt + v + p)


@functools.cache
def optin_smem_bytes(device: torch.device) -> int:
    """The most dynamic shared memory a block may opt into on this device."""
    props = torch.cuda.get_device_properties(device)
    reported = getattr(props, "shared_memory_per_block_optin", 0)
    return int(reported) or OPTIN_SMEM_BYTES.get((props.major, props.minor), 49_152)


def prefill_rows_per_warp(head_size: int, limit: int, device_name: str = "this GPU") -> int:
    """The prefill tile for a device granting `limit` bytes of shared memory per block: 8 rows per
    warp where it fits, 4 (the smaller tile, head 256 only) where only that fits; else refused."""
    if prefill_smem_bytes(head_size) <= limit:
        return PREFILL_ROWS_PER_WARP
    small = prefill_smem_bytes(head_size, PREFILL_SMALL_ROWS_PER_WARP)
    if head_size == PREFILL_SMALL_TILE_HEAD and small <= limit:
        return PREFILL_SMALL_ROWS_PER_WARP
    need = small if head_size == PREFILL_SMALL_TILE_HEAD else prefill_smem_bytes(head_size)
    raise ValueError(
        f"prefill attention at head size {head_size} needs {need} bytes of shared memory per block "
        f"(its smallest tile); {device_name} allows {limit}: use a device with more shared memory or "
        "--attention-backend reference")


def check_cuda_cache(name: str, cache: torch.Tensor) -> None:
    """A cache the CUDA kernels are compiled for: block and head sizes, 16-byte aligned base. Float
    caches of the model dtype and int8 caches (rows of head_size values + their fp16 scale) alike."""
    block_size, head_size = cache.shape[2], head_size_of(cache)
    if block_size not in CUDA_BLOCK_SIZES:
        raise ValueError(f"{name}: CUDA block size must be one of {CUDA_BLOCK_SIZES}; got {block_size}")
    if head_size not in CUDA_HEAD_SIZES:
        raise ValueError(f"{name}: CUDA head size must be one of {CUDA_HEAD_SIZES}; got {head_size}")
    if cache.data_ptr() % 16 != 0:
        raise ValueError(f"{name} must be 16-byte aligned for vectorized loads (slice whole blocks)")


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
