"""The CUDA kernels' error flag: what they skipped because an index tensor held a bad value.

Block-table entries, cache slots, context lengths and ``query_start_loc`` live in device tensors,
so checking them on the host would cost a device sync per call. The kernels check them instead,
skip the work an index would have sent out of bounds, and set one byte of an 8-byte flag in mapped,
pinned host memory (``ErrorKind`` in csrc/ops.h). Every CUDA wrapper reads that flag first through
ctypes: a host memory load, no sync and no kernel launch (two calls per layer per step: the RoPE
cache write and attention). So an
error is raised by the first CUDA op called after the faulty kernel has finished (at the latest
one step later: the engine syncs each step when it reads the sampled tokens), or at once by
``raise_device_errors(sync=True)``.
"""

from __future__ import annotations

import ctypes

import torch

from ops.build import cuda_ops

# Byte index -> what the kernel saw (csrc/ops.h ErrorKind, same order)
ERROR_KINDS = (
    "a block-table entry outside [0, num_blocks)",
    "a context length outside [0, block_tables width x block_size], or shorter than its query",
    "a cache slot at or past num_blocks x block_size",
    "query_start_loc not non-decreasing within [0, num_tokens]",
    "a RoPE position outside the cos/sin table (left unrotated)",
)
FLAG_BYTES = 8  # csrc/ops.h kErrorFlagBytes


class DeviceIndexError(RuntimeError):
    """A CUDA kernel skipped work because an index tensor held an out-of-range value."""


def describe(flag: bytes) -> list[str]:
    """The kinds of error the flag's bytes record (non-zero bytes), in ErrorKind order."""
    return [kind for kind, byte in zip(ERROR_KINDS, flag, strict=False) if byte]


_cell: list[ctypes.c_uint64] = []  # the flag, mapped on first use (a list lookup is the cheapest read)


def _flag() -> ctypes.c_uint64:
    if not _cell:
        _cell.append(ctypes.c_uint64.from_address(int(cuda_ops().error_flag_address())))
    return _cell[0]


def take(flag: ctypes.c_uint64) -> bytes:
    """The flag's bytes (one per ErrorKind), cleared for the next error."""
    seen = flag.value.to_bytes(FLAG_BYTES, "little")
    flag.value = 0
    return seen


def raise_device_errors(sync: bool = False) -> None:
    """Raise DeviceIndexError if a kernel flagged a bad index since the last call (and clear it).
    With ``sync``, first wait for every kernel queued on the current device."""
    if sync:
        torch.cuda.synchronize()
    flag = _flag()
    if flag.value:
        raise DeviceIndexError("a CUDA kernel skipped work on bad indices (its output is not valid): "
                               + "; ".join(describe(take(flag))))
