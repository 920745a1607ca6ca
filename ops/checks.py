"""Argument checks run before any kernel launch: errors a user can act on, never a crash inside C++."""

from __future__ import annotations

import torch

from ops.checks_cuda import check_cuda_cache
from ops.reference.kv_quant import head_size_of

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# A cache holds the model dtype, or int8 rows with their scale (ops/reference/kv_quant.py).
CACHE_DTYPES = (*FLOAT_DTYPES, torch.int8)


def _dtype(name: str, tensor: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if tensor.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise TypeError(f"{name} must have dtype {names}; got {str(tensor.dtype).removeprefix('torch.')}")


def _ndim(name: str, tensor: torch.Tensor, ndim: int, layout: str) -> None:
    if tensor.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D {layout}; got shape {tuple(tensor.shape)}")


def _same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        listing = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise ValueError(f"tensors must be on one device; got {listing}")


def holds(cache: torch.Tensor, dtype: torch.dtype, head_size: int) -> bool:
    """Whether rows of ``dtype`` and ``head_size`` can be stored in (and read from) ``cache``: a float
    cache of that dtype, or an int8 cache of ``head_size + 2`` bytes per row."""
    return (cache.dtype == dtype or cache.dtype == torch.int8) and head_size_of(cache) == head_size


def check_cache(name: str, cache: torch.Tensor) -> None:
    """A cache is a contiguous 4-D ``[num_blocks, num_kv_heads, block_size, head_size]`` float tensor,
    or int8 ``[..., head_size + 2]`` (each row's int8 values, then its fp16 scale)."""
    _ndim(name, cache, 4, "[num_blocks, num_kv_heads, block_size, head_size]")
    _dtype(name, cache, CACHE_DTYPES)
    if not cache.is_contiguous():
        raise ValueError(f"{name} must be contiguous (written in place); got strides {cache.stride()}")
    if cache.is_cuda:
        check_cuda_cache(name, cache)


def cache_pair_ok(key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    """The common case of `check_cache_pair`, in one expression: the checks run several times per
    layer per step, so the full ones (which explain what is wrong) run only when this is False."""
    return (key_cache.dim() == 4 and key_cache.dtype in CACHE_DTYPES and not key_cache.is_cuda
            and key_cache.is_contiguous() and value_cache.is_contiguous() and value_cache.shape == key_cache.shape
            and value_cache.dtype == key_cache.dtype and value_cache.device == key_cache.device)


def check_cache_pair(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    """Key and value caches of one layer: valid each, and alike in shape, dtype and device."""
    if cache_pair_ok(key_cache, value_cache):
        return
    check_cache("key_cache", key_cache)
    check_cache("value_cache", value_cache)
    if key_cache.shape != value_cache.shape or key_cache.dtype != value_cache.dtype:
        raise ValueError(
            f"key_cache {tuple(key_cache.shape)} {key_cache.dtype} and value_cache "
            f"{tuple(value_cache.shape)} {value_cache.dtype} must match in shape and dtype"
        )
    _same_device(key_cache=key_cache, value_cache=value_cache)


def _check_query(query: torch.Tensor, key_cache: torch.Tensor, layout: str) -> None:
    """A 3-D query whose dtype and head size match the cache and whose heads group over its KV heads."""
    _ndim("query", query, 3, layout)
    _dtype("query", query, FLOAT_DTYPES)
    if query.dtype != key_cache.dtype and key_cache.dtype != torch.int8:
        raise TypeError(f"query dtype {query.dtype} differs from the cache dtype {key_cache.dtype}")
    _, num_heads, head_size = query.shape
    num_kv_heads = key_cache.shape[1]
    if head_size != head_size_of(key_cache):
        raise ValueError(f"query head_size {head_size} differs from the cache head_size {head_size_of(key_cache)}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")
    if query.stride(2) != 1:
        raise ValueError("query must be contiguous in its last (head_size) dimension")


def _check_out(out: torch.Tensor | None, query: torch.Tensor) -> None:
    if out is None:
        return
    if out.shape != query.shape or out.dtype != query.dtype or out.device != query.device:
        raise ValueError(f"out must match query {tuple(query.shape)} {query.dtype} on {query.device}")
    if out.stride(2) != 1:
        raise ValueError("out must be contiguous in its last (head_size) dimension")


def check_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    out: torch.Tensor | None,
) -> None:
    """Everything ``paged_attention`` needs to be true of its arguments."""
    if (cache_pair_ok(key_cache, value_cache) and query.dim() == 3 and query.dtype in FLOAT_DTYPES
            and holds(key_cache, query.dtype, query.shape[2]) and query.shape[1] % key_cache.shape[1] == 0
            and query.stride(2) == 1 and block_tables.dim() == 2 and block_tables.dtype == torch.int32
            and context_lens.dim() == 1 and context_lens.dtype == torch.int32
            and block_tables.shape[0] == context_lens.shape[0] == query.shape[0]
            and query.device == key_cache.device == block_tables.device == context_lens.device
            and (out is None or (out.shape == query.shape and out.dtype == query.dtype and out.device == query.device
                                 and out.stride(2) == 1))):
        return
    check_cache_pair(key_cache, value_cache)
    _check_query(query, key_cache, "[num_seqs, num_heads, head_size]")
    num_seqs = query.shape[0]
    _ndim("block_tables", block_tables, 2, "[num_seqs, max_blocks_per_seq]")
    _dtype("block_tables", block_tables, (torch.int32,))
    _ndim("context_lens", context_lens, 1, "[num_seqs]")
    _dtype("context_lens", context_lens, (torch.int32,))
    if block_tables.shape[0] != num_seqs or context_lens.shape[0] != num_seqs:
        raise ValueError(
            f"block_tables {tuple(block_tables.shape)} and context_lens {tuple(context_lens.shape)} "
            f"must have num_seqs={num_seqs} rows"
        )
    _same_device(query=query, key_cache=key_cache, block_tables=block_tables, context_lens=context_lens)
    _check_out(out, query)


def check_decode_lengths(key_cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor) -> None:
    """Context lengths fit the block tables. The CPU kernels check this themselves (no tensor ops
    per layer); the reference runs it, and CUDA skips it (it would cost a device sync)."""
    if context_lens.numel() == 0:
        return
    capacity = block_tables.shape[1] * key_cache.shape[2]
    longest, shortest = int(context_lens.max()), int(context_lens.min())
    if longest > capacity or shortest < 0:
        raise ValueError(
            f"context_lens must lie in [0, {capacity}] (block_tables width x block_size); got [{shortest}, {longest}]"
        )


def check_prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    out: torch.Tensor | None,
) -> None:
    """Everything ``paged_prefill_attention`` needs to be true of its arguments."""
    check_cache_pair(key_cache, value_cache)
    _check_query(query, key_cache, "[num_tokens, num_heads, head_size]")
    _ndim("block_tables", block_tables, 2, "[num_seqs, max_blocks_per_seq]")
    _dtype("block_tables", block_tables, (torch.int32,))
    _ndim("query_start_loc", query_start_loc, 1, "[num_seqs + 1]")
    _dtype("query_start_loc", query_start_loc, (torch.int32,))
    _ndim("context_lens", context_lens, 1, "[num_seqs]")
    _dtype("context_lens", context_lens, (torch.int32,))
    num_seqs = context_lens.shape[0]
    if block_tables.shape[0] != num_seqs or query_start_loc.shape[0] != num_seqs + 1:
        raise ValueError(
            f"block_tables {tuple(block_tables.shape)}, query_start_loc {tuple(query_start_loc.shape)} and "
            f"context_lens {tuple(context_lens.shape)} must describe num_seqs={num_seqs} sequences"
        )
    _same_device(query=query, key_cache=key_cache, block_tables=block_tables, query_start_loc=query_start_loc,
                 context_lens=context_lens)
    _check_out(out, query)


def check_prefill_lengths(query: torch.Tensor, key_cache: torch.Tensor, block_tables: torch.Tensor,
                          query_start_loc: torch.Tensor, context_lens: torch.Tensor) -> None:
    """Query ranges are ordered and each fits its context, which fits its block table. The CPU
    kernel checks this itself; the reference runs it; CUDA skips it (a device sync)."""
    if context_lens.numel():
        starts = query_start_loc.to(torch.int64)
        q_lens = starts[1:] - starts[:-1]
        if int(starts[0]) < 0 or int(q_lens.min()) < 0 or int(starts[-1]) > query.shape[0]:
            raise ValueError(
                f"query_start_loc must be non-decreasing within [0, {query.shape[0]}] (num_tokens); "
                f"got {query_start_loc.tolist()[:8]}..."
            )
        capacity = block_tables.shape[1] * key_cache.shape[2]
        if bool((q_lens > context_lens).any()) or int(context_lens.max()) > capacity:
            raise ValueError(
                f"each context_len must cover its query tokens and fit the block table ({capacity} slots); "
                f"got query lengths {q_lens.tolist()[:8]} and context_lens {context_lens.tolist()[:8]}"
            )


def check_cache_write(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Everything ``reshape_and_cache`` needs to be true of its arguments."""
    check_cache_pair(key_cache, value_cache)
    for name, tensor in (("key", key), ("value", value)):
        _ndim(name, tensor, 3, "[num_tokens, num_kv_heads, head_size]")
        if tuple(tensor.shape[1:]) != (key_cache.shape[1], head_size_of(key_cache)):
            raise ValueError(
                f"{name} {tuple(tensor.shape)} does not fit the cache: expected [*, {key_cache.shape[1]}, "
                f"{head_size_of(key_cache)}] (num_kv_heads, head_size)"
            )
        _dtype(name, tensor, FLOAT_DTYPES)
        if tensor.dtype != key_cache.dtype and key_cache.dtype != torch.int8:
            raise TypeError(f"{name} dtype {tensor.dtype} differs from the cache dtype {key_cache.dtype}")
        if tensor.stride(2) != 1:
            raise ValueError(f"{name} must be contiguous in its last (head_size) dimension")
    _ndim("slot_mapping", slot_mapping, 1, "[num_tokens]")
    _dtype("slot_mapping", slot_mapping, (torch.int64,))
    if not key.shape[0] == value.shape[0] == slot_mapping.shape[0]:
        raise ValueError(
            f"key ({key.shape[0]}), value ({value.shape[0]}) and slot_mapping ({slot_mapping.shape[0]}) "
            "must have the same number of tokens"
        )
    _same_device(key=key, value=value, key_cache=key_cache, slot_mapping=slot_mapping)


def check_block_mapping(block_mapping: torch.Tensor) -> None:
    """An int64 ``[n, 2]`` tensor of (src, dst) block ids."""
    _ndim("block_mapping", block_mapping, 2, "[n, 2] of (src, dst) block ids")
    _dtype("block_mapping", block_mapping, (torch.int64,))
    if block_mapping.shape[1] != 2:
        raise ValueError(f"block_mapping must be [n, 2]; got {tuple(block_mapping.shape)}")


def check_copy(
    key_caches: list[torch.Tensor], value_caches: list[torch.Tensor], mapping: torch.Tensor
) -> None:
    """Everything ``copy_blocks`` needs: one (key, value) cache pair per layer, all on one device."""
    if len(key_caches) != len(value_caches):
        raise ValueError(f"{len(key_caches)} key caches but {len(value_caches)} value caches")
    check_block_mapping(mapping)
    for key_cache, value_cache in zip(key_caches, value_caches, strict=True):
        check_cache_pair(key_cache, value_cache)
        _same_device(first_key_cache=key_caches[0], key_cache=key_cache)


def check_swap(src: torch.Tensor, dst: torch.Tensor, mapping: torch.Tensor) -> None:
    """Everything ``swap_blocks`` needs: same block layout and dtype, mapping on the CPU."""
    check_cache("src", src)
    check_cache("dst", dst)
    if src.shape[1:] != dst.shape[1:] or src.dtype != dst.dtype:
        raise ValueError(
            f"src {tuple(src.shape)} {src.dtype} and dst {tuple(dst.shape)} {dst.dtype} "
            "must share block shape and dtype"
        )
    check_block_mapping(mapping)
    if mapping.device.type != "cpu":
        raise ValueError(f"block_mapping must be on the CPU; got {mapping.device}")
    if src.is_cuda and dst.is_cuda and src.device != dst.device:
        raise ValueError(f"swap_blocks between two GPUs ({src.device} -> {dst.device}) is not supported")
