"""How many KV blocks fit: a byte budget on the CPU, a memory profile on CUDA."""

from __future__ import annotations

import torch

from common.log import get_logger
from engine.config import EngineConfig

log = get_logger("capacity")


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but torch sees no CUDA device")
    return torch.device(device)


def resolve_model_dtype(dtype: str, device: torch.device, cpuinfo: str | None = None,
                        quantized_weights: bool = False) -> str:
    """auto: fp32 for quantized GGUF weights (their kernels take fp32 activations); bf16 on CUDA;
    on the CPU bf16 where it computes bf16 natively (avx512_bf16 or amx_bf16 in ``cpuinfo``,
    default /proc/cpuinfo), else fp32 (an emulated bf16 GEMM is no faster). Logs the choice and why."""
    if dtype != "auto":
        return dtype
    if quantized_weights:
        choice, reason = "float32", "quantized weights compute with fp32 activations"
    elif device.type == "cuda":
        choice, reason = "bfloat16", "cuda device"
    else:
        from ops.screen import cpuinfo_native_bf16, native_bf16

        native = native_bf16() if cpuinfo is None else cpuinfo_native_bf16(cpuinfo)
        choice = "bfloat16" if native else "float32"
        reason = "cpu computes bf16 natively (avx512_bf16/amx_bf16)" if native else "cpu has no native bf16"
    log.info("dtype auto", dtype=choice, reason=reason)
    return choice


def num_device_blocks(config: EngineConfig, block_bytes: int, device: torch.device,
                      profile_peak_bytes: int = 0) -> int:
    """Device blocks: `kv_cache_memory` bytes on the CPU; on CUDA the utilization share of the
    card minus what the weights and the profiled peak activation take."""
    if config.num_gpu_blocks is not None:
        return config.num_gpu_blocks
    if device.type != "cuda":
        return config.kv_cache_memory // block_bytes
    _, total = torch.cuda.mem_get_info(device)
    used_by_torch = torch.cuda.memory_allocated(device)
    budget = config.gpu_memory_utilization * total - used_by_torch - profile_peak_bytes
    return max(int(budget // block_bytes), 0)


def num_host_blocks(config: EngineConfig, block_bytes: int) -> int:
    if config.num_cpu_blocks is not None:
        return config.num_cpu_blocks
    return config.swap_space // block_bytes


def log_capacity(num_blocks: int, block_size: int, block_bytes: int, max_model_len: int,
                 kv_cache_dtype: str = "") -> None:
    tokens = num_blocks * block_size
    log.info(
        "kv cache",
        dtype=kv_cache_dtype,
        blocks=num_blocks,
        tokens_per_gib=int(2**30 // block_bytes * block_size),
        block_size=block_size,
        gib=round(num_blocks * block_bytes / 2**30, 3),
        tokens=tokens,
        max_concurrency_at_max_len=round(tokens / max_model_len, 2),
    )
