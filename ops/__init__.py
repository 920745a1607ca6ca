"""Python face of the paged-attention kernels: build, dispatch, checks and the torch reference."""

from ops import reference
from ops.backend import get_backend, set_backend
from ops.reference import copy_blocks, paged_attention, reshape_and_cache, swap_blocks

__all__ = [
    "copy_blocks",
    "get_backend",
    "paged_attention",
    "reference",
    "reshape_and_cache",
    "set_backend",
    "swap_blocks",
]
