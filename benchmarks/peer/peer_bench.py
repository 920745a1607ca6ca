"""pagedserve against vLLM's CPU build, side by side in one invocation: same weights (fp32), same
KV pool size, same traces. JSON lines on stdout (one per system and part, then the ratio),
progress on stderr.

Parts (`--only`, comma-separated):
  offline  the ShareGPT-like trace of benchmarks/engine/engine_bench.py (same generator and seed; 128
           requests, prompt and output lengths 16-256, greedy, fixed output lengths), SmolLM2,
           one generate call per run, the fastest of --repeats (2) runs per system; also how
           many requests' greedy tokens agree exactly
  tiny     SmolLM2's shape cut to 2 layers with random weights (step time is nearly all engine
           overhead): 256 sequences, random 32-token prompts, 256 output tokens each; fastest
           of --repeats
  single   one request alone (batch 1), SmolLM2: decode tok/s = N / (t(prompt + N + 1 tokens)
           - t(prompt + 1 token)), prompt 32 tokens, N = 256; best of 2
  served   `pagedserve up` then `vllm serve` (never both at once), each driven by `vllm bench
           serve --backend openai --dataset-name random` (128 in / 128 out, 96 requests,
           ignore_eos): all at once, then at most 32 concurrent

vLLM runs from its own virtualenv (a benchmark tool, never a dependency): `bash
benchmarks/peer/setup_vllm.sh`. Without it the vLLM figures (and the served part, whose client
is vLLM's) are skipped with a message.

    python benchmarks/peer/peer_bench.py --json-out artifacts/peer/peer_bench.jsonl
    python benchmarks/peer/peer_bench.py --quick --only offline,single

Per ISA level, cap both sides (the setup line records the caps): `PAGEDSERVE_CPU_ISA=avx512
ONEDNN_MAX_CPU_ISA=AVX512_CORE_VNNI python benchmarks/peer/peer_bench.py --only offline ...`. vLLM's
oneDNN GEMMs follow ONEDNN_MAX_CPU_ISA; its own attention and cache kernels follow the machine.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # this checkout's engine/ and benchmarks/, also when run as a script

from benchmarks.peer import parts  # noqa: E402
from benchmarks.peer.cli import parse_args  # noqa: E402


class Emitter:
    """JSON lines to stdout and, with --json-out, to a file; every line stamped with the load."""

    def __init__(self, path: str | None) -> None:
        self.file = open(path, "w") if path else None  # noqa: SIM115 (lives for the whole run)

    def __call__(self, record: dict[str, Any]) -> None:
        line = json.dumps(record | {"loadavg_1m": round(os.getloadavg()[0], 2)})
        print(line, flush=True)
        if self.file:
            self.file.write(line + "\n")
            self.file.flush()


def main() -> int:
    args = parse_args(__doc__)
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
    emit = Emitter(args.json_out)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="peer-bench-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    venv = parts.vllm_venv(args.vllm_venv)
    emit({"part": "setup", "model": parts.model_dir(args), "kv_cache_gib": args.kv_cache_gib, "quick": args.quick,
          "vllm_venv": str(venv) if venv else None, "cpus": os.cpu_count(), "log_dir": str(log_dir),
          "omp_env": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")},
          "isa_caps": {k: os.environ.get(k)
                       for k in ("PAGEDSERVE_CPU_ISA", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")},
          "uptime": parts.uptime()})
    start = time.perf_counter()
    for name in args.only:
        print(f"== {name}", file=sys.stderr, flush=True)
        try:
            parts.PARTS[name](args, venv, log_dir, emit)
        except RuntimeError as exc:  # one part failing (a server that would not start) spares the others
            print(f"{name}: failed: {exc}", file=sys.stderr, flush=True)
            emit({"part": name, "error": str(exc).splitlines()[0]})
    emit({"part": "done", "seconds": round(time.perf_counter() - start, 1), "uptime": parts.uptime()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
