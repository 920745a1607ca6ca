"""Random paged caches and block tables for the attention kernel tests (decode and prefill)."""

from __future__ import annotations

import random

import torch

TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-3, torch.bfloat16: 1.6e-2}
HEAD_PAIRS = [(8, 8), (9, 3), (32, 8), (16, 1)]  # (num_heads, num_kv_heads): MHA, GQA 3 and 4, MQA
Inputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def context_lengths(num_seqs: int, block_size: int, rng: random.Random, long: int = 0) -> list[int]:
    """Edge lengths first (1, block_size - 1, block_size, block_size + 1), then random ones."""
    edges = [1, block_size - 1, block_size, block_size + 1]
    lens = [edges[i] if i < len(edges) else rng.randint(1, 300) for i in range(num_seqs)]
    if long:
        lens[rng.randrange(num_seqs)] = long
    rng.shuffle(lens)
    return lens


def make_paged(
    lens: list[int],
    heads: tuple[int, int],
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    device: str,
    seed: int,
) -> Inputs:
    """Random query and caches; each sequence gets random, non-contiguous physical blocks.

    Table columns past a sequence's blocks hold -1 and every unused slot holds NaN, so a
    kernel that reads past a context either fails or produces NaN.
    """
    gen = torch.Generator().manual_seed(seed)
    num_heads, num_kv_heads = heads
    blocks_per_seq = [(n + block_size - 1) // block_size for n in lens]
    num_blocks = sum(blocks_per_seq) + 5
    shape = (num_blocks, num_kv_heads, block_size, head_size)
    key_cache = torch.randn(shape, generator=gen)
    value_cache = torch.randn(shape, generator=gen)
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.full((len(lens), max(blocks_per_seq) + 2), -1, dtype=torch.int32)
    filled = torch.zeros(num_blocks, dtype=torch.int64)  # tokens stored per physical block
    used = 0
    for seq, (n, nb) in enumerate(zip(lens, blocks_per_seq, strict=True)):
        ids = order[used : used + nb]
        used += nb
        tables[seq, :nb] = ids.to(torch.int32)
        filled[ids] = (n - torch.arange(nb) * block_size).clamp(max=block_size)
    stale = torch.arange(block_size)[None, :] >= filled[:, None]  # [num_blocks, block_size]
    key_cache.masked_fill_(stale[:, None, :, None], float("nan"))
    value_cache.masked_fill_(stale[:, None, :, None], float("nan"))
    query = torch.randn(len(lens), num_heads, head_size, generator=gen)
    context_lens = torch.tensor(lens, dtype=torch.int32)
    query, key_cache, value_cache = (t.to(device=device, dtype=dtype) for t in (query, key_cache, value_cache))
    return query, key_cache, value_cache, tables.to(device), context_lens.to(device)


PrefillInputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def make_prefill(
    pairs: list[tuple[int, int]],
    heads: tuple[int, int],
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    device: str,
    seed: int,
) -> PrefillInputs:
    """Prefill inputs for sequences given as ``(q_len, context_len)``: the paged caches of
    :func:`make_paged` (shuffled blocks, NaN in every slot past a context) and the queries of the
    last ``q_len`` tokens of each context, as a strided view into a wider qkv-like tensor (the way
    the model hands them over). Returns query, caches, block tables, query_start_loc, context_lens.
    """
    q_lens, lens = [q for q, _ in pairs], [c for _, c in pairs]
    _, key_cache, value_cache, tables, context_lens = make_paged(lens, heads, head_size, block_size, dtype,
                                                                 device, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    num_heads, num_kv_heads = heads
    qkv = torch.randn(sum(q_lens), num_heads + 2 * num_kv_heads, head_size, generator=gen)
    query = qkv.to(device=device, dtype=dtype)[:, :num_heads]
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return query, key_cache, value_cache, tables, starts, context_lens


def rope_and_cache_both(qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, caches: torch.Tensor,
                        slots: torch.Tensor, num_heads: int, num_kv_heads: int,
                        head_size: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """`(qkv, key_cache, value_cache)` after `ops.rotary_embedding_and_cache` and after the torch
    reference, each run on its own copies of `qkv` and `caches` (`[2, blocks, ...]`: keys, values)."""
    import ops

    results = []
    for fn in (ops.rotary_embedding_and_cache, ops.reference.rotary_embedding_and_cache):
        buf, key_cache, value_cache = qkv.clone(), caches[0].clone(), caches[1].clone()
        sizes = [num_heads * head_size, num_kv_heads * head_size, num_kv_heads * head_size]
        q, k, v = (t.unflatten(-1, (-1, head_size)) for t in buf.split(sizes, -1))
        fn(positions, q, k, v, cos_sin, key_cache, value_cache, slots)
        results.append((buf, key_cache, value_cache))
    return results
