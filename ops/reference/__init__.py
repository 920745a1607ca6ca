"""Every op in plain torch: slow, obviously correct, the oracle the kernels are tested against and
what ``ops.REFERENCE`` (``OpsPolicy(reference=True)``) runs. Cache layout per layer: ``[num_blocks, num_kv_heads,
block_size, head_size]``."""

from ops.reference.attention import paged_attention, paged_prefill_attention
from ops.reference.cache import copy_blocks, reshape_and_cache, swap_blocks
from ops.reference.fused import fused_add_rms_norm, linear, rms_norm, rotary_embedding_and_cache, silu_and_mul
from ops.reference.sampling import sample_filtered, sample_from_logits
from ops.reference.screen import screened_argmax

__all__ = [
    "copy_blocks",
    "fused_add_rms_norm",
    "linear",
    "paged_attention",
    "paged_prefill_attention",
    "reshape_and_cache",
    "rms_norm",
    "rotary_embedding_and_cache",
    "sample_filtered",
    "sample_from_logits",
    "screened_argmax",
    "silu_and_mul",
    "swap_blocks",
]
