"""A rank other than 0: load this rank's part of the model, allocate the KV cache of its heads
with the group's block count, then run every step rank 0 sends until SHUTDOWN (and put the LoRA
adapters it places in this rank's slots: `engine.model.lora.mirror`).

Any failure ends the process (rank 0's watcher then fails the group); so does rank 0's death
(a collective on its closed connections raises, and a parent watch catches the rest).
"""

from __future__ import annotations

import os
import threading
import time
import traceback
from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.model.spec import ModelSpec
from engine.parallel.channel import Rendezvous, join
from engine.parallel.step_message import Command, control_payload, header, unpack

PARENT_POLL_S = 0.5


@dataclass(frozen=True, slots=True, kw_only=True)
class RankArgs:
    """What rank 0 hands a rank it spawns (picklable)."""

    config: EngineConfig
    spec: ModelSpec  # the model's shapes, as rank 0 read them
    rank: int
    rendezvous: Rendezvous
    device: str  # rank 0's resolved device ("cpu", "cuda:0"); rank r takes the r-th GPU after it
    dtype: str  # the model dtype rank 0 resolved ("float32", ...)
    kv_dtype: str  # the KV cache dtype rank 0 resolved
    threads: int  # torch threads of this rank
    profile_tokens: int  # tokens of the CUDA memory profile's step (rank 0's figure)


def rank_device(device: str, rank: int) -> torch.device:
    """`cuda[:N]` becomes this rank's GPU (rank 0's index + rank); the CPU stays the CPU."""
    if device.startswith("cuda"):
        base = int(device.split(":")[1]) if ":" in device else 0
        return torch.device("cuda", base + rank)
    return torch.device("cpu")


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_S)
    os._exit(1)  # rank 0 is gone: nothing will send another step


def rank_main(args: RankArgs) -> None:
    """The process body of ranks 1..N-1."""
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    torch.set_num_threads(args.threads)
    from common.log import get_logger

    log = get_logger("parallel.rank")
    try:
        _serve(args)
    except BaseException as exc:
        log.error("tensor-parallel rank failed", rank=args.rank, error=repr(exc),
                  traceback=traceback.format_exc(limit=8))
        os._exit(1)


def _serve(args: RankArgs) -> None:
    from engine.model.capacity import engine_policy, num_device_blocks, num_host_blocks, profile_peak, resolve_compute
    from engine.model.kv_cache import allocate_kv_caches, kv_bytes_per_block
    from engine.model.loader import load_model, resolve_dtype
    from engine.model.lora.mirror import RankLoRA
    from engine.model.runner import ModelRunner
    from engine.model.sharding import TPShard
    from ops.build import prepare as prepare_kernels

    config = args.config
    device = rank_device(args.device, args.rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if config.attention_backend == "auto":
        prepare_kernels(device)
    groups = join(args.rendezvous, args.rank)
    shard = TPShard(args.rank, groups.size, groups.compute)
    policy = engine_policy(config, resolve_dtype(args.dtype), resolve_compute(config, device)[1], device)  # rank 0's
    model = load_model(config.model, device=device, quantization=config.quantization, shard=shard, spec=args.spec,
                       policy=policy)
    if device.type == "cpu" and config.attention_backend == "auto":  # which threads kernels share, as on rank 0
        from engine.model.quant_linear import all_linears_quantized
        from ops.parallel import openmp_rows_for, set_openmp_rows
        set_openmp_rows(openmp_rows_for(all_linears_quantized(model), policy.ops.fixed_order))
    # the adapter slots before the profile, as on rank 0 (it counts them and their products)
    lora = RankLoRA(model, config.max_loras, config.max_lora_rank) if config.enable_lora else None
    kv_dtype = getattr(torch, args.kv_dtype)
    kv_spec = shard.kv_spec(model.spec)
    block_bytes = kv_bytes_per_block(kv_spec, config.block_size, kv_dtype)
    peak = (profile_peak(model, args.profile_tokens, config.max_num_seqs, kv_spec, config.block_size, kv_dtype,
                         device, lora is not None) if device.type == "cuda" else 0)
    num_blocks = groups.all_reduce_min(num_device_blocks(config, block_bytes, device, peak))
    num_cpu = groups.all_reduce_min(num_host_blocks(config, block_bytes))
    kv = allocate_kv_caches(kv_spec, num_blocks, config.block_size, kv_dtype, device)
    host = allocate_kv_caches(kv_spec, num_cpu, config.block_size, kv_dtype, "cpu")
    runner = ModelRunner(model, kv, host, config.block_size, device)
    with torch.inference_mode():
        while True:
            message = groups.receive()
            command = header(message)["command"]
            if command == Command.SHUTDOWN:
                break
            if command == Command.LORA:
                if lora is None:
                    raise RuntimeError("rank 0 placed a LoRA adapter, but this rank has no adapter slots")
                lora.apply(control_payload(message))
                continue
            runner.run_inputs(unpack(message))
    groups.close()
