"""The environment vLLM's CPU build runs under in these benchmarks: its KV pool size and its OpenMP
threads bound to every core this process may use (its default binding keeps one core for its front
end, about half as fast offline on two cores; ../shared/NOTES.md), and a step watchdog long enough
for a CPU prefill step of a real-size model (vLLM's default gives up on a step after 300 seconds,
which its bf16 prefill of a few thousand tokens of a 1.7B model on two cores without AVX512-BF16
outlasts; the watchdog changes no timing). A value already set wins."""

from __future__ import annotations

import os


def vllm_env(kv_cache_gib: int | float) -> dict[str, str]:
    """Variables to add to os.environ for a vLLM process with a `kv_cache_gib` KV pool."""
    cores = sorted(os.sched_getaffinity(0))
    env = {"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib)}
    if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cores))
    if "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS" not in os.environ:
        env["VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"] = "7200"
    return env
