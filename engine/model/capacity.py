"""How many KV blocks fit: a byte budget on the CPU, a memory profile on CUDA."""

from __future__ import annotations

from typing import Any

import torch

from common.log import get_logger
from engine.config import EngineConfig
from engine.model.attention import AttentionMetadata
from engine.model.execution_policy import ExecutionPolicy
from engine.model.kv_cache import allocate_kv_caches
from engine.model.loader import resolve_dtype
from ops.policy import OpsPolicy

log = get_logger("capacity")


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but torch sees no CUDA device")
    return torch.device(device)


def resolve_model_dtype(dtype: str, device: torch.device, cpuinfo: str | None = None,
                        quantized_weights: bool = False) -> str:
    """auto: for quantized GGUF weights bf16 where the CPU has the bf16 kernel (AVX512-BF16 or AMX:
    their linears then compute a step's prompt rows, or on AMX every row of a step of many rows, in
    bf16: `resolve_compute`, `ops.quant.bf16_all_rows`), else fp32; bf16 on CUDA; on the
    CPU bf16 where it computes bf16 natively (avx512_bf16 or amx_bf16 in ``cpuinfo``, default
    /proc/cpuinfo), else fp32 (an emulated bf16 GEMM is no faster). Logs the choice and why."""
    if dtype != "auto":
        return dtype
    if quantized_weights:
        from ops.screen import bf16_kernel_cpu, cpuinfo_bf16_kernel

        kernel = bf16_kernel_cpu() if cpuinfo is None else cpuinfo_bf16_kernel(cpuinfo)
        choice = "bfloat16" if kernel else "float32"
        reason = ("quantized weights: prompt rows and many-row steps on the bf16 kernel" if kernel
                  else "quantized weights: no AVX512-BF16 (the kernels round fp32 activations to int8)")
    elif device.type == "cuda":
        choice, reason = "bfloat16", "cuda device"
    else:
        from ops.screen import cpuinfo_native_bf16, native_bf16

        native = native_bf16() if cpuinfo is None else cpuinfo_native_bf16(cpuinfo)
        choice = "bfloat16" if native else "float32"
        reason = "cpu computes bf16 natively (avx512_bf16/amx_bf16)" if native else "cpu has no native bf16"
    log.info("dtype auto", dtype=choice, reason=reason)
    return choice


def resolve_compute(config: EngineConfig, device: torch.device) -> tuple[torch.dtype, bool]:
    """`(dtype, bf16_linears)`: the model's activation and KV dtype, and whether its quantized
    linears compute in bf16 (`ExecutionPolicy.bf16_linears`). A quantized GGUF model keeps fp32
    activations and gets bf16 linears for dtype bfloat16 (auto picks it where the CPU has
    AVX512-BF16); float16 is refused for it. Other models run in the resolved dtype."""
    quantized = config.serves_quantized_weights
    choice = resolve_model_dtype(config.dtype, device, quantized_weights=quantized)
    if not quantized:
        return resolve_dtype(choice), False
    if choice == "float16":
        raise ValueError("quantized GGUF weights compute in float32 or bfloat16; got dtype float16 "
                         "(pass quantization='dequantize' to convert the weights instead)")
    return torch.float32, choice == "bfloat16"


def engine_policy(config: EngineConfig, dtype: torch.dtype, bf16_linears: bool,
                  device: torch.device) -> ExecutionPolicy:
    """The execution policy of an engine's model (every rank's): `(dtype, bf16_linears)` as
    `resolve_compute` gave them, the logit screen and exact prompt rows as `config` says, and the
    ops' arithmetic (`OpsPolicy`): `attention_backend`'s kernels or reference, fixed order where
    `deterministic` asks for it on the CPU (every rank rounds as rank 0)."""
    arithmetic = OpsPolicy.of(config.attention_backend, config.deterministic and device.type == "cpu")
    return ExecutionPolicy(dtype=dtype, logit_screen=config.logit_screen, exact_prompt_rows=config.exact_prompt_rows,
                           bf16_linears=bf16_linears, ops=arithmetic)


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
                 kv_cache_dtype: str = "", tensor_parallel_size: int = 1) -> None:
    """The pool's figures; `block_bytes` and `gib` are one rank's (each holds its heads' share)."""
    tokens = num_blocks * block_size
    log.info(
        "kv cache",
        dtype=kv_cache_dtype,
        tensor_parallel_size=tensor_parallel_size,
        blocks=num_blocks,
        tokens_per_gib=int(2**30 // block_bytes * block_size),
        block_size=block_size,
        gib=round(num_blocks * block_bytes / 2**30, 3),
        tokens=tokens,
        max_concurrency_at_max_len=round(tokens / max_model_len, 2),
    )


def profile_peak(model: Any, num_tokens: int, max_num_seqs: int, kv_spec: Any, block_size: int,
                 kv_dtype: torch.dtype, device: torch.device, lora: bool = False) -> int:
    """Peak activation bytes of the largest step (`num_tokens` prefill tokens, logits of up to
    `max_num_seqs` rows), measured with an empty cache; with `lora`, every row through adapter
    slot 0 (the products' gathered weights count too). Every rank of a tensor-parallel group runs
    it at the same point of start-up (its all-reduces pair up)."""
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    n = num_tokens
    empty = allocate_kv_caches(kv_spec, 0, block_size, kv_dtype, device)
    meta = AttentionMetadata(
        slot_mapping=torch.full((n,), -1, dtype=torch.int64, device=device),
        num_prefills=1, num_prefill_tokens=n, prefill_query_start=[0, n], prefill_context_lens=[n],
        prefill_block_tables=torch.zeros((1, 0), dtype=torch.int32, device=device),
        decode_block_tables=torch.zeros((0, 0), dtype=torch.int32, device=device),
        decode_context_lens=torch.zeros((0,), dtype=torch.int32, device=device),
        lora_slots=torch.zeros(n, dtype=torch.int64, device=device) if lora else None,
    )
    ids = torch.zeros(n, dtype=torch.int64, device=device)
    hidden = model(ids, torch.arange(n, device=device), empty, meta)
    model.compute_logits(hidden[-min(n, max_num_seqs):])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    torch.cuda.empty_cache()
    return int(peak)


def kv_layers(windows: tuple[int, ...], max_model_len: int, block_size: int) -> dict[str, Any]:
    """Per-layer KV bound of one sequence: sliding layers (`ModelSpec.layer_windows`) need at most
    their window of tokens, full-attention layers the whole context. The pool shares one block
    table across layers, so blocks behind the window are released (`release_window`) only where
    every layer slides; a mixed model (Gemma 3, gpt-oss) keeps every block until the sequence ends."""
    window = release_window(windows)
    sliding = [w for w in windows if w]
    return {
        "layers": len(windows),
        "sliding_layers": len(sliding),
        "window": max(sliding, default=0),
        "sliding_layer_tokens": min(max(sliding, default=max_model_len), max_model_len),
        "full_layer_tokens": max_model_len if len(sliding) < len(windows) else 0,
        "release_behind_window": bool(window),
        # blocks one decoding sequence holds once the window releases its past (its step's tokens aside)
        "max_blocks_per_seq": (window - 1) // block_size + 2 if window else -(-max_model_len // block_size),
    }


def release_window(windows: tuple[int, ...]) -> int:
    """The window behind which a sequence's blocks may go back to the pool: the widest of the
    layers' windows when every layer slides, else 0 (a full-attention layer reads every block)."""
    return max(windows) if windows and all(windows) else 0


def log_kv_layers(layers: dict[str, Any]) -> None:
    """The startup line of the per-layer KV bound (only for a model with sliding layers)."""
    if not layers["sliding_layers"]:
        return
    if layers["release_behind_window"]:
        note = "every layer slides: blocks behind the window go back to the pool"
    else:
        note = "full-attention layers read every block: nothing is released behind the window"
    log.info("kv per layer", note=note, **layers)
