"""Python face of the paged-attention kernels: build, dispatch, checks and the torch reference.

``set_backend("reference")`` routes every op to the plain-torch oracle in :mod:`ops.reference`;
``"auto"`` (the default) uses the compiled kernels: C++ for CPU tensors, CUDA for CUDA tensors.
"""

from ops import reference
from ops.attention import paged_attention
from ops.backend import get_backend, set_backend
from ops.build import KernelBuildError
from ops.cache import copy_blocks, reshape_and_cache, swap_blocks

__all__ = [
    "KernelBuildError",
    "copy_blocks",
    "get_backend",
    "paged_attention",
    "reference",
    "reshape_and_cache",
    "set_backend",
    "swap_blocks",
]
