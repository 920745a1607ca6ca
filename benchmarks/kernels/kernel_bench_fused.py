"""Fused decoder-op benchmark: each kernel against the unfused torch code it replaced (which is
also its reference): residual add + RMSNorm, SiLU-and-mul, RoPE + K/V cache write."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout's root: benchmarks.* importable
import ops
from benchmarks.helpers.timing import bandwidth_fields, best_seconds
from engine.model.rope import RotaryEmbedding, apply_rotary

# SmolLM2-135M: hidden 576, intermediate 1536, 9 heads / 3 KV heads of 64; on CUDA a Llama-8B layer.
CPU_SHAPE = {"hidden": 576, "intermediate": 1536, "heads": 9, "kv_heads": 3, "head": 64, "dtype": "float32"}
CUDA_SHAPE = {"hidden": 4096, "intermediate": 14336, "heads": 32, "kv_heads": 8, "head": 128, "dtype": "bfloat16"}


def _old_rope(rope: RotaryEmbedding, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              caches: tuple[torch.Tensor, torch.Tensor], slots: torch.Tensor) -> None:
    """What LlamaAttention did before: rotate out of place, then reshape_and_cache."""
    _rotated_q, k2 = apply_rotary(q, k, *rope.cos_sin(positions, q.dtype))
    ops.reshape_and_cache(k2, v, caches[0], caches[1], slots)


def bench_fused(rows: int, shape: dict, device: str, budget_s: float, peak_gbps: float) -> list[dict]:
    """The three fused ops at one row count (decode batch or prefill tokens)."""
    dtype = getattr(torch, shape["dtype"])
    item = torch.empty((), dtype=dtype).element_size()
    hidden, inter, heads, kv_heads, head = (shape[k] for k in ("hidden", "intermediate", "heads", "kv_heads", "head"))
    x, residual = (torch.randn(rows, hidden, device=device, dtype=dtype) for _ in range(2))
    weight = torch.randn(hidden, device=device, dtype=dtype)
    gate_up = torch.randn(rows, 2 * inter, device=device, dtype=dtype)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head, device=device, dtype=dtype)
    q, k, v = (t.unflatten(-1, (-1, head)) for t in qkv.split([heads * head, kv_heads * head, kv_heads * head], -1))
    block_size = 16
    num_blocks = (rows + block_size - 1) // block_size + 1
    caches = tuple(torch.zeros(num_blocks, kv_heads, block_size, head, device=device, dtype=dtype) for _ in range(2))
    slots = torch.randperm(num_blocks * block_size, device=device)[:rows]
    positions = torch.randint(0, 4096, (rows,), device=device)
    rope = RotaryEmbedding({"rope_theta": 10000.0}, head, 8192)
    table = rope.table(positions)
    cases: dict[str, tuple[int, dict[str, Callable[[], object]]]] = {
        "add_rms_norm": (4 * rows * hidden * item, {
            "kernel": lambda: ops.fused_add_rms_norm(x, residual, weight, 1e-5),
            "torch_unfused": lambda: ops.reference.fused_add_rms_norm(x, residual, weight, 1e-5),
        }),
        "silu_and_mul": (3 * rows * inter * item, {
            "kernel": lambda: ops.silu_and_mul(gate_up),
            "torch_unfused": lambda: ops.reference.silu_and_mul(gate_up),
        }),
        "rope_and_cache": ((2 * (heads + kv_heads) + 3 * kv_heads) * head * rows * item, {
            "kernel": lambda: ops.rotary_embedding_and_cache(positions, q, k, v, table, *caches, slots),
            "torch_unfused": lambda: _old_rope(rope, positions, q, k, v, caches, slots),
        }),
    }
    out: list[dict] = []
    for op, (num_bytes, calls) in cases.items():
        times = best_seconds(calls, device, budget_s)
        for impl, sec in times.items():
            out.append({"bench": "fused", "op": op, "impl": impl, "device": device, "rows": rows,
                        "dtype": shape["dtype"], "us": round(sec * 1e6, 2),
                        **bandwidth_fields(num_bytes, sec, device, peak_gbps)})
        out.append({"bench": "fused_summary", "op": op, "device": device, "rows": rows,
                    "speedup_vs_unfused": round(times["torch_unfused"] / times["kernel"], 2)})
    return out
