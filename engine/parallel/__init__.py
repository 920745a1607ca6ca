"""Tensor parallelism over torch.distributed: rank 0 (the engine process) spawns ranks 1..N-1,
broadcasts each step's inputs, and fails the whole group when one rank fails.

Modules: `channel` (the two process groups, the step broadcast), `step_message` (a step as one
int64 tensor), `rank` (the loop of ranks 1..N-1), `group` (rank 0's side). The shard arithmetic
the model uses is `engine.model.sharding`.
"""

from __future__ import annotations

import torch

from engine.config import EngineConfig
from engine.model.sharding import TPShard
from engine.model.spec import ModelSpec
from engine.parallel.group import EXIT_RANK_FAILED, TensorParallelError, TensorParallelGroup

__all__ = ["EXIT_RANK_FAILED", "TensorParallelError", "TensorParallelGroup", "start_group"]


def start_group(config: EngineConfig, spec: ModelSpec, device: torch.device, dtype: torch.dtype,
                kv_dtype: torch.dtype, profile_tokens: int) -> TensorParallelGroup | None:
    """The group of `config.tensor_parallel_size` ranks with this process as rank 0, or None for 1.
    Rank 0 runs with as many torch threads as every other rank (`tensor_parallel_threads`, else
    this process's threads / N)."""
    size = config.tensor_parallel_size
    if size == 1:
        return None
    TPShard(0, size).check(spec)  # refuse before spawning anything
    previous = torch.get_num_threads()
    threads = config.tensor_parallel_threads or max(1, previous // size)
    torch.set_num_threads(threads)
    name = str(device) if device.type == "cpu" else f"cuda:{device.index or 0}"
    try:
        group = TensorParallelGroup(config, spec, name, _name(dtype), _name(kv_dtype), threads, profile_tokens)
    except BaseException:
        torch.set_num_threads(previous)
        raise
    group.previous_threads = previous  # restored by close()
    return group


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
