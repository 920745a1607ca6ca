"""Python face of the kernels (paged attention, cache ops, fused decoder ops, small-batch linear,
GGUF-quantized linear):
build, dispatch, checks and the torch reference.

Every op takes ``policy=`` (an ``OpsPolicy``, :mod:`ops.policy`): ``REFERENCE`` routes it to the
plain-torch oracle in :mod:`ops.reference`; ``FASTEST`` (the default) uses the compiled kernels (C++
for CPU tensors, CUDA for CUDA tensors); ``fixed_order`` asks for one arithmetic per row at any
row count. There is no process-wide switch: each caller passes the policy its engine built.
"""

from ops import isa, reference
from ops.attention import paged_attention, paged_prefill_attention
from ops.build import KernelBuildError
from ops.cache import copy_blocks, reshape_and_cache, swap_blocks
from ops.device_errors import DeviceIndexError, raise_device_errors
from ops.fused import fused_add_rms_norm, rms_norm, rotary_embedding_and_cache, silu_and_mul
from ops.linear import SMALL_GEMM_MAX_ROWS, can_pack, linear, pack_fixed, pack_weight
from ops.policy import FASTEST, FIXED_ORDER, REFERENCE, OpsPolicy
from ops.quant import QuantFormat, dequantize, quant_format, quant_linear
from ops.sampling import sample_filtered, sample_from_logits
from ops.screen import native_bf16, pack_screen_weight, screen_logits, screened_argmax, weight_norms

isa.apply_onednn_cap()  # before oneDNN's first use: PAGEDSERVE_CPU_ISA caps torch's kernels too

__all__ = [
    "FASTEST",
    "FIXED_ORDER",
    "REFERENCE",
    "SMALL_GEMM_MAX_ROWS",
    "DeviceIndexError",
    "KernelBuildError",
    "OpsPolicy",
    "QuantFormat",
    "can_pack",
    "copy_blocks",
    "dequantize",
    "fused_add_rms_norm",
    "isa",
    "linear",
    "native_bf16",
    "pack_fixed",
    "pack_screen_weight",
    "pack_weight",
    "paged_attention",
    "paged_prefill_attention",
    "quant_format",
    "quant_linear",
    "raise_device_errors",
    "reference",
    "reshape_and_cache",
    "rms_norm",
    "rotary_embedding_and_cache",
    "sample_filtered",
    "sample_from_logits",
    "screen_logits",
    "screened_argmax",
    "silu_and_mul",
    "swap_blocks",
    "weight_norms",
]
