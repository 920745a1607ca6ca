"""The offline parts of benchmarks/peer/peer_bench.py: one workload, run by pagedserve in-process and by
vLLM in a subprocess of its own venv, each timed around one generate call for the whole workload.

A workload is `Run`s (named lists of prompt token ids with exact output lengths); both systems
decode greedily with ignore_eos, so every request produces exactly its output length."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.peer.vllm_env import vllm_env
from common.openmp_env import peer_environ

VLLM_RUNNER = Path(__file__).resolve().parent / "vllm_offline.py"


@dataclass
class Run:
    """One timed generate call: the requests and whether to return their token ids."""

    name: str
    prompts: list[list[int]]
    output_lens: list[int]
    return_tokens: bool = False


@dataclass
class Workload:
    """Runs on one model, after one untimed warm-up request."""

    model: str
    runs: list[Run]
    warmup: tuple[list[int], int]
    max_model_len: int = 2048
    kv_cache_gib: int = 2
    extra: dict[str, Any] = field(default_factory=dict)
    pagedserve_model: str | None = None  # what pagedserve loads instead of `model` (the same weights' GGUF)
    vllm_dtype: str = "float32"
    pagedserve_dtype: str = "float32"
    pagedserve_kv_cache_dtype: str = "auto"  # auto: the model dtype; int8: `pagedserve up`'s default on a GGUF
    pagedserve_exact_prompt_rows: bool = True  # False: --int8-prompt-activations
    pagedserve_deterministic: bool = True  # False: --no-deterministic (row-count switches allowed)


def _generate(llm: Any, prompts: list[list[int]], lens: list[int]) -> tuple[float, list[list[int]]]:
    """One timed `LLM.generate` call, greedy, every request exactly its length; (seconds, token ids)."""
    from common.sampling_params import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True) for n in lens]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    return time.perf_counter() - t0, [list(o.outputs[0].token_ids) for o in outs]


def run_pagedserve(work: Workload) -> dict[str, Any]:
    """The workload through `engine.llm.LLM` in this process; the engine is freed afterwards."""
    import torch

    from engine.llm import LLM

    start = time.perf_counter()
    model = work.pagedserve_model or work.model
    tokenizer = work.model if work.pagedserve_model else None
    llm = LLM(model, tokenizer=tokenizer, dtype=work.pagedserve_dtype, kv_cache_dtype=work.pagedserve_kv_cache_dtype,
              kv_cache_memory=work.kv_cache_gib << 30, max_model_len=work.max_model_len,
              exact_prompt_rows=work.pagedserve_exact_prompt_rows, deterministic=work.pagedserve_deterministic)
    startup = time.perf_counter() - start
    try:
        _generate(llm, [work.warmup[0]], [work.warmup[1]])
        runs: dict[str, Any] = {}
        for run in work.runs:
            print(f"pagedserve: {run.name} ({len(run.prompts)} requests)", file=sys.stderr, flush=True)
            seconds, token_ids = _generate(llm, run.prompts, run.output_lens)
            runs[run.name] = {"seconds": seconds, "output_tokens": sum(len(t) for t in token_ids)}
            if run.return_tokens:
                runs[run.name]["token_ids"] = token_ids
        cfg = llm.engine.config
        config = {"max_num_seqs": cfg.max_num_seqs, "max_num_batched_tokens": llm.engine.token_budget,
                  "threads": torch.get_num_threads(), "dtype": work.pagedserve_dtype,
                  "kv_cache_dtype": work.pagedserve_kv_cache_dtype,
                  "exact_prompt_rows": work.pagedserve_exact_prompt_rows,
                  "deterministic": work.pagedserve_deterministic}
        return {"startup_s": startup, "config": config, "runs": runs}
    finally:
        del llm
        gc.collect()  # the KV pool goes back before vLLM starts


def run_vllm(work: Workload, venv: Path, log_path: Path) -> dict[str, Any]:
    """The workload through vLLM's `LLM` in a subprocess (the venv's python); its output to `log_path`."""
    job = {"model": work.model, "dtype": work.vllm_dtype, "max_model_len": work.max_model_len,
           "warmup": list(work.warmup),
           "runs": [asdict(r) for r in work.runs]}
    job_path, result_path = log_path.with_suffix(".job.json"), log_path.with_suffix(".result.json")
    job_path.write_text(json.dumps(job))
    result_path.unlink(missing_ok=True)
    env = peer_environ() | vllm_env(work.kv_cache_gib)
    print(f"vllm: starting on {Path(work.model).name} (log {log_path})", file=sys.stderr, flush=True)
    with log_path.open("w") as log:
        proc = subprocess.run([str(venv / "bin" / "python"), str(VLLM_RUNNER), str(job_path), str(result_path)],
                              stdout=log, stderr=subprocess.STDOUT, env=env, check=False)
    if proc.returncode != 0 or not result_path.is_file():
        tail = log_path.read_text(errors="replace").splitlines()[-15:]
        raise RuntimeError(f"vLLM exited with {proc.returncode}; last lines of {log_path}:\n" + "\n".join(tail))
    result: dict[str, Any] = json.loads(result_path.read_text())
    result["config"]["compute_threads"] = _vllm_threads(log_path)
    return result


def _vllm_threads(log_path: Path) -> str | None:
    """The OpenMP core binding vLLM logged (its CPU worker pins compute threads, reserving a core)."""
    for line in log_path.read_text(errors="replace").splitlines():
        if "core ids=" in line:
            return line.split("core ids=", 1)[1].strip()
    return None


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict[str, Any]:
    """How many requests produced identical greedy token ids, and the mean agreed prefix share."""
    same = sum(a == b for a, b in zip(ours, theirs, strict=True))
    prefix = []
    for a, b in zip(ours, theirs, strict=True):
        n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        prefix.append(n / max(len(a), 1))
    return {"identical_requests": same, "requests": len(ours),
            "mean_common_prefix_share": round(sum(prefix) / max(len(prefix), 1), 4)}
