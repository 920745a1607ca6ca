"""Prefill attention benchmark: the batched varlen paged kernel against the path it replaced (one
SDPA per sequence, the cached context gathered into a contiguous tensor first) and the reference."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout's root: benchmarks.* importable
import ops
from benchmarks.helpers.timing import best_seconds


@dataclass(frozen=True)
class PrefillPoint:
    """A step's prefill sequences: ``num_seqs`` of ``q_len`` new tokens after ``cached`` cached ones."""

    name: str
    num_seqs: int
    q_len: int
    cached: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int
    dtype: str


CPU_POINTS = [
    PrefillPoint("burst", 16, 128, 0, 9, 3, 64, 16, "float32"),  # SmolLM2: 16 prompts arrive together
    PrefillPoint("chunked", 1, 512, 1536, 9, 3, 64, 16, "float32"),  # a late chunk of a long prompt
    PrefillPoint("prefix_hit", 8, 32, 992, 9, 3, 64, 16, "float32"),  # shared 992-token prefix, short tails
    PrefillPoint("burst", 4, 256, 0, 32, 8, 128, 16, "float32"),
]
CUDA_POINTS = [
    PrefillPoint("burst", 64, 128, 0, 9, 3, 64, 16, "bfloat16"),
    PrefillPoint("burst", 16, 1024, 0, 32, 8, 128, 16, "bfloat16"),
    PrefillPoint("chunked", 1, 2048, 6144, 32, 8, 128, 16, "bfloat16"),
    PrefillPoint("prefix_hit", 32, 64, 4032, 32, 8, 128, 16, "bfloat16"),
]


def make_inputs(p: PrefillPoint, device: str) -> dict[str, torch.Tensor]:
    """Paged caches with shuffled blocks, the step's queries and the fresh K/V of its new tokens."""
    dtype = getattr(torch, p.dtype)
    context = p.cached + p.q_len
    blocks_per_seq = (context + p.block_size - 1) // p.block_size
    tables = torch.randperm(p.num_seqs * blocks_per_seq).view(p.num_seqs, blocks_per_seq)
    shape = (p.num_seqs * blocks_per_seq, p.num_kv_heads, p.block_size, p.head_size)
    tokens = p.num_seqs * p.q_len
    tensors = {
        "key_cache": torch.randn(shape), "value_cache": torch.randn(shape),
        "query": torch.randn(tokens, p.num_heads, p.head_size),
        "key": torch.randn(tokens, p.num_kv_heads, p.head_size),
        "value": torch.randn(tokens, p.num_kv_heads, p.head_size),
    }
    out = {k: v.to(device=device, dtype=dtype) for k, v in tensors.items()}
    out["block_tables"] = tables.to(device=device, dtype=torch.int32)
    out["query_start_loc"] = (torch.arange(p.num_seqs + 1) * p.q_len).to(device=device, dtype=torch.int32)
    out["context_lens"] = torch.full((p.num_seqs,), context, device=device, dtype=torch.int32)
    return out


def sdpa_loop(p: PrefillPoint, t: dict[str, torch.Tensor], scale: float) -> torch.Tensor:
    """The replaced path (engine/model/attention.py before the kernel): one SDPA per sequence, fresh
    K/V for a whole prompt, else the context gathered from its blocks plus an explicit causal mask."""
    out = torch.empty_like(t["query"])
    context = p.cached + p.q_len
    for s in range(p.num_seqs):
        lo, hi = s * p.q_len, (s + 1) * p.q_len
        q = t["query"][lo:hi].transpose(0, 1)
        if p.cached == 0:
            k, v, mask = t["key"][lo:hi].transpose(0, 1), t["value"][lo:hi].transpose(0, 1), None
        else:
            blocks = t["block_tables"][s, : (context + p.block_size - 1) // p.block_size].long()
            k = t["key_cache"][blocks].transpose(0, 1).flatten(1, 2)[:, :context]
            v = t["value_cache"][blocks].transpose(0, 1).flatten(1, 2)[:, :context]
            q_pos = torch.arange(p.cached, context, device=q.device)
            mask = torch.arange(context, device=q.device)[None, :] <= q_pos[:, None]
        attn = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, is_causal=mask is None,
                                              scale=scale, enable_gqa=p.num_heads != p.num_kv_heads)
        out[lo:hi] = attn[0].transpose(0, 1)
    return out


def bench_prefill(p: PrefillPoint, device: str, budget_s: float, with_reference: bool) -> list[dict]:
    """Kernel, old SDPA loop and (optionally) reference at one point; rows plus a summary row."""
    t = make_inputs(p, device)
    scale = p.head_size**-0.5
    args = [t[k] for k in ("query", "key_cache", "value_cache", "block_tables", "query_start_loc", "context_lens")]
    out = torch.empty_like(t["query"])
    calls: dict[str, Callable[[], object]] = {
        "kernel": lambda: ops.paged_prefill_attention(*args, scale, out=out),
        "sdpa_loop": lambda: sdpa_loop(p, t, scale),
    }
    if with_reference:
        calls["reference"] = lambda: ops.reference.paged_prefill_attention(*args, scale)
    times = best_seconds(calls, device, budget_s)
    context = p.cached + p.q_len
    visible = p.q_len * p.cached + p.q_len * (p.q_len + 1) / 2  # causal (query, key) pairs per sequence
    flops = 4 * p.num_seqs * p.num_heads * p.head_size * visible
    rows: list[dict] = [
        {"bench": "paged_prefill_attention", "impl": impl, "device": device, **asdict(p), "context": context,
         "ms": round(sec * 1e3, 3), "gflops": round(flops / sec / 1e9, 1)}
        for impl, sec in times.items()
    ]
    summary = {"bench": "paged_prefill_summary", "device": device, **asdict(p),
               "speedup_vs_sdpa_loop": round(times["sdpa_loop"] / times["kernel"], 2)}
    if with_reference:
        summary["speedup_vs_reference"] = round(times["reference"] / times["kernel"], 2)
    return [*rows, summary]
