"""`pagedserve plan`: KV-cache capacity arithmetic, paged against contiguous preallocation.

pool = utilization x GPU memory - weights - workspace - LoRA adapter slots; bytes per block =
2 (K and V) x layers x block_size x kv_heads x head_dim x dtype bytes; blocks = pool // block;
max concurrency = blocks // blocks per sequence (paged, at the average request length) against
pool // (max_model_len x bytes per token) (contiguous, every sequence reserves max_model_len).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, replace
from fractions import Fraction
from pathlib import Path

from common.sizes import format_size, parse_size
from pagedserve.plan.model_shape import KVShape, PlanError, lora_slot_bytes, read_model_dir

DEFAULT_MAX_MODEL_LEN = 8192


@dataclass(frozen=True, slots=True)
class Plan:
    """Every figure of one capacity plan (bytes unless named otherwise)."""

    pool_bytes: int
    block_size: int
    block_bytes: int
    bytes_per_token: int
    num_blocks: int
    avg_tokens: int
    blocks_per_seq: int
    max_seqs_paged: int
    max_model_len: int
    contiguous_bytes_per_seq: int
    max_seqs_contiguous: int
    gain: float | None  # paged / contiguous concurrency; None when contiguous fits nothing
    tensor_parallel_size: int = 1  # ranks (GPUs); pool, block and per-token bytes above are one rank's
    lora_bytes: int = 0  # one rank's LoRA adapter slots (--max-loras x one slot at --max-lora-rank)


def rank_shape(shape: KVShape, tensor_parallel_size: int) -> KVShape:
    """One rank's share of a token's KV: its KV heads (split, or one replicated head when the ranks
    outnumber them), as the engine allocates it (`engine.model.sharding`)."""
    n, kv = tensor_parallel_size, shape.num_kv_heads
    if n < 1:
        raise PlanError(f"--tensor-parallel-size must be >= 1, got {n}")
    if kv % n and n % kv:
        raise PlanError(f"--tensor-parallel-size {n} neither divides the {kv} KV heads nor is a multiple of them")
    return replace(shape, num_kv_heads=max(1, kv // n))


def kv_pool_bytes(gpu_memory: int, utilization: float, weights: int, workspace: int) -> int:
    """Bytes left for the KV cache; exact rational arithmetic so 0.9 x 80 GiB is not 1 byte short."""
    return math.floor(Fraction(str(utilization)) * gpu_memory) - weights - workspace


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks holding ``num_tokens`` tokens (the last one possibly partial)."""
    return -(-num_tokens // block_size)


def plan_capacity(
    shape: KVShape,
    *,
    gpu_memory: int,
    utilization: float,
    weights: int,
    workspace: int,
    block_size: int,
    avg_tokens: int,
    max_model_len: int,
    tensor_parallel_size: int = 1,
    lora_bytes: int = 0,
) -> Plan:
    """The plan for one model shape and budget; raises PlanError on nonsensical input. With
    `tensor_parallel_size` N, `gpu_memory` is each GPU's and the weights split N ways; every rank
    holds its heads' share of every block, so the group has one rank's block count. `lora_bytes`:
    one rank's LoRA adapter slots (its part of each adapter), taken from its pool like the weights."""
    _check_inputs(gpu_memory, utilization, weights, workspace, block_size, avg_tokens, max_model_len)
    shape = rank_shape(shape, tensor_parallel_size)
    if lora_bytes < 0:
        raise PlanError("lora_bytes must not be negative")
    pool = kv_pool_bytes(gpu_memory, utilization, -(-weights // tensor_parallel_size) + lora_bytes, workspace)
    block_bytes = shape.bytes_per_token * block_size
    if pool < block_bytes:
        raise PlanError(
            f"KV pool of {format_size(pool)} ({utilization} x {format_size(gpu_memory)} - "
            f"{format_size(weights)} weights - {format_size(workspace)} workspace"
            f"{f' - {format_size(lora_bytes)} LoRA slots' if lora_bytes else ''}) "
            f"is smaller than one block ({format_size(block_bytes)})"
        )
    num_blocks = pool // block_bytes
    blocks_per_seq = blocks_for(avg_tokens, block_size)
    contiguous_bytes = max_model_len * shape.bytes_per_token
    paged = num_blocks // blocks_per_seq
    contiguous = pool // contiguous_bytes
    return Plan(
        pool_bytes=pool,
        block_size=block_size,
        block_bytes=block_bytes,
        bytes_per_token=shape.bytes_per_token,
        num_blocks=num_blocks,
        avg_tokens=avg_tokens,
        blocks_per_seq=blocks_per_seq,
        max_seqs_paged=paged,
        max_model_len=max_model_len,
        contiguous_bytes_per_seq=contiguous_bytes,
        max_seqs_contiguous=contiguous,
        gain=paged / contiguous if contiguous else None,
        tensor_parallel_size=tensor_parallel_size,
        lora_bytes=lora_bytes,
    )


def _check_inputs(
    gpu_memory: int, utilization: float, weights: int, workspace: int, *counts: int
) -> None:
    if gpu_memory <= 0:
        raise PlanError("--gpu-memory must be positive")
    if not 0.0 < utilization <= 1.0:
        raise PlanError(f"--gpu-memory-utilization must be in (0, 1], got {utilization}")
    if weights < 0 or workspace < 0:
        raise PlanError("--weights and --workspace must not be negative")
    block_size, avg_tokens, max_model_len = counts
    for flag, value in (("--block-size", block_size), ("--avg-tokens", avg_tokens),
                        ("--max-model-len", max_model_len)):
        if value <= 0:
            raise PlanError(f"{flag} must be a positive integer, got {value}")
    if avg_tokens > max_model_len:
        raise PlanError(f"--avg-tokens ({avg_tokens}) exceeds --max-model-len ({max_model_len})")


def format_plan(plan: Plan, shape: KVShape) -> str:
    """The plan as a short readable report."""
    gain = f"{plan.gain:.1f}x" if plan.gain is not None else "contiguous fits none"
    per_rank = (f" ({max(1, shape.num_kv_heads // plan.tensor_parallel_size)} per rank)"
                if plan.tensor_parallel_size > 1 else "")
    ranks = f"tensor parallel  {plan.tensor_parallel_size} ranks: the bytes and the pool below are one rank's"
    return "\n".join([
        *([ranks] if plan.tensor_parallel_size > 1 else []),
        f"model shape      {shape.num_layers} layers x {shape.num_kv_heads} KV heads{per_rank} x "
        f"head {shape.head_dim} x {shape.dtype_bytes} B{f' + {shape.scale_bytes} B scale' if shape.scale_bytes else ''}"
        f" = {format_size(plan.bytes_per_token)} per token",
        *([f"LoRA slots       {format_size(plan.lora_bytes)} (taken from the pool)"] if plan.lora_bytes else []),
        f"KV pool          {format_size(plan.pool_bytes)}",
        f"block            {plan.block_size} tokens = {format_size(plan.block_bytes)}",
        f"blocks           {plan.num_blocks}",
        f"per sequence     {plan.blocks_per_seq} blocks ({plan.avg_tokens} tokens)",
        f"max concurrency  paged {plan.max_seqs_paged}  vs  contiguous {plan.max_seqs_contiguous} "
        f"at max_model_len {plan.max_model_len}  ({gain})",
    ])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `pagedserve plan`."""
    parser.add_argument("--model", type=Path, help="Hugging Face model directory or config.json")
    parser.add_argument("--layers", type=int, help="decoder layers (num_hidden_layers)")
    parser.add_argument("--kv-heads", type=int, help="key/value heads (num_key_value_heads)")
    parser.add_argument("--head-dim", type=int, help="head dimension")
    parser.add_argument("--kv-cache-dtype", "--dtype", dest="dtype",
                        help="KV dtype: fp16, bf16, fp32, fp8, int8 (pagedserve's int8 rows carry a 2-byte "
                             "scale); default fp16 or the model's")
    parser.add_argument("--gpu-memory", default="80GiB", help="GPU memory, e.g. 80GiB (default)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="default 0.9")
    parser.add_argument("--weights", help="weight bytes, e.g. 16GiB (default: --model's weight files, or 0)")
    parser.add_argument("--workspace", default="0", help="activation/workspace bytes (default 0)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16)")
    parser.add_argument("--avg-tokens", type=int, default=512, help="prompt + output tokens (default 512)")
    parser.add_argument("--max-model-len", type=int, help=f"default: the model's, or {DEFAULT_MAX_MODEL_LEN}")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="GPUs the model is split over (default 1); --gpu-memory is each one's")
    parser.add_argument("--max-loras", type=int, default=0,
                        help="LoRA adapter slots the engine holds (its --max-loras; needs --model; default 0: none)")
    parser.add_argument("--max-lora-rank", type=int, default=16, help="the engine's --max-lora-rank (default 16)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def run(args: argparse.Namespace) -> int:
    """Print the plan; exit code 2 with a one-line message on bad input."""
    try:
        shape, plan = _plan_from_args(args)
    except PlanError as exc:
        print(f"pagedserve plan: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"shape": asdict(shape), **asdict(plan)}, indent=2))
    else:
        print(format_plan(plan, shape))
    return 0


def _plan_from_args(args: argparse.Namespace) -> tuple[KVShape, Plan]:
    model = read_model_dir(args.model) if args.model else None
    shape = KVShape.from_parts(
        args.layers if args.layers is not None else model and model.shape.num_layers,
        args.kv_heads if args.kv_heads is not None else model and model.shape.num_kv_heads,
        args.head_dim if args.head_dim is not None else model and model.shape.head_dim,
        args.dtype or (model.dtype if model else "fp16"),
    )
    weights = model.weights if model else 0
    if args.weights is not None:
        weights = _size("--weights", args.weights)
    loras = 0
    if args.max_loras:
        if model is None or args.max_loras < 0 or args.max_lora_rank < 1:
            raise PlanError("--max-loras needs --model (the slots are sized by its projections) and "
                            "--max-lora-rank >= 1")
        loras = lora_slot_bytes(model, args.max_loras, args.max_lora_rank, max(1, args.tensor_parallel_size))
    max_len = args.max_model_len
    if max_len is None:
        max_len = (model.max_model_len if model else None) or DEFAULT_MAX_MODEL_LEN
    plan = plan_capacity(
        shape,
        gpu_memory=_size("--gpu-memory", args.gpu_memory),
        utilization=args.gpu_memory_utilization,
        weights=weights,
        workspace=_size("--workspace", args.workspace),
        block_size=args.block_size,
        avg_tokens=args.avg_tokens,
        max_model_len=max_len,
        tensor_parallel_size=args.tensor_parallel_size,
        lora_bytes=loras,
    )
    return shape, plan


def _size(flag: str, text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise PlanError(f"{flag}: {exc}") from None
