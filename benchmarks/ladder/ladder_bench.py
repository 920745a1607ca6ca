"""The size ladder, side by side in one run: pagedserve against llama.cpp (same GGUF, its default
params) and vLLM bf16 (the same weights' HF folder), each rung's one stream also as a share of this
machine's measured memory-bandwidth limit. JSON lines.

    .venv/bin/python benchmarks/ladder/ladder_bench.py --rungs smollm2-1.7b --formats Q4_K_M,Q4_0 \\
        --peer-python ~/.cache/pagedserve/peer/llama-cpp-venv/bin/python \\
        [--vllm-venv ~/.cache/pagedserve/peer/vllm-venv] [--vllm-dtype bfloat16] [--parts decode,trace]

``--rungs`` also takes ``config.json`` paths (a Llama, Mistral or Qwen2 decoder's shape, random weights as
for the ladder's own rungs), and ``--gguf FILE[,FILE]`` runs the decode part on files of one's own (their
embedded tokenizer unless ``--tokenizer``), so any shape or file is measured the same way.

Per rung (``make_rung.py`` makes its files first, once) and format:
- ``decode``: ``peer/llama_cpp_engine.py`` on the file, one stream and a batch of 32, rounds
  interleaved with llama.cpp's (pagedserve as ``up`` serves a GGUF: dtype auto, int8 KV);
- ``bandwidth``: this machine's streaming read (``torch.sum`` over a 2 GiB fp32 tensor on
  ``--threads`` threads, best of 5), measured before and after each format's decode part, the
  higher kept (another process's burst lowers a read, never raises it); a one-stream step must
  read every weight of the file once (the embedding row aside; a tied lm_head reads the embedding
  matrix), so ``limit_tok_s`` = bandwidth / those bytes, and each system's ``share`` = its tok/s
  over that limit (the KV cache's reads are left out: at 64 + 16 positions a few percent at most);
- ``trace``: ``peer/peer_bench.py --only offline`` (the 128-request ShareGPT-like trace), pagedserve
  on the GGUF against vLLM bf16 on the HF folder.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.ladder.make_rung import make_rung  # noqa: E402
from benchmarks.ladder.shapes import FORMATS, RUNGS, resolve_rung  # noqa: E402

PARTS = ("decode", "trace")


def read_bandwidth(threads: int, gib: int = 2, repeats: int = 5) -> float:
    """Bytes per second of the best of `repeats` sums over a `gib` GiB fp32 tensor."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        data = torch.ones(gib << 28, dtype=torch.float32)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            data.sum()
            best = min(best, time.perf_counter() - start)
        return data.numel() * 4 / best
    finally:
        torch.set_num_threads(before)


def weight_bytes_per_token(gguf_path: str) -> int:
    """Bytes a one-stream decode step must read: every tensor once, but the token embedding unless
    the lm_head is tied to it (then the lm_head's read is the embedding matrix)."""
    import gguf

    tensors = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(gguf_path).tensors}
    total = sum(tensors.values())
    return total if "output.weight" not in tensors else total - tensors.get("token_embd.weight", 0)


def _json_lines(out: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def decode(args: argparse.Namespace, gguf_path: str, tokenizer: str | None) -> list[dict[str, Any]]:
    """``llama_cpp_engine.py`` on one file: its engine and ratio lines (`tokenizer` None: the file's own)."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "peer" / "llama_cpp_engine.py"), "--gguf", gguf_path,
           "--peer-python", args.peer_python, "--batches", args.batches, "--rounds", str(args.rounds),
           "--steps", str(args.steps), "--threads", str(args.threads), "--kv-cache-dtype", "int8"]
    if tokenizer:
        cmd += ["--tokenizer", tokenizer]
    return _json_lines(subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT).stdout)


def trace(args: argparse.Namespace, hf: str, gguf_path: str) -> list[dict[str, Any]]:
    """``peer_bench.py --only offline``: pagedserve on the GGUF against vLLM (``--vllm-dtype``) on the folder."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "peer" / "peer_bench.py"), "--only", "offline",
           "--model", hf, "--pagedserve-model", gguf_path, "--vllm-dtype", args.vllm_dtype,
           "--pagedserve-dtype", "auto", "--pagedserve-kv-cache-dtype", "int8",
           "--num-requests", str(args.num_requests), "--repeats", "1"]
    if args.vllm_venv:
        cmd += ["--vllm-venv", args.vllm_venv]
    return _json_lines(subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT).stdout)


def shares(lines: list[dict[str, Any]], limit_tok_s: float) -> list[dict[str, Any]]:
    """Each one-stream engine line's share of the bandwidth limit."""
    return [{"system": line["system"], "tok_s": line["tok_s"], "share_of_limit": round(line["tok_s"] / limit_tok_s, 3)}
            for line in lines if line.get("part") == "engine" and line.get("batch") == 1]


def decode_with_share(args: argparse.Namespace, base: dict[str, Any], gguf_path: str, tokenizer: str | None) -> None:
    """The decode part of one file, between two reads of the machine's bandwidth: its engine lines,
    the limit (the higher read over the file's bytes per token) and each one stream's share of it."""
    before = read_bandwidth(args.threads)
    lines = decode(args, gguf_path, tokenizer)
    after = read_bandwidth(args.threads)
    bandwidth, weights = max(before, after), weight_bytes_per_token(gguf_path)
    limit = bandwidth / weights
    print(json.dumps({"part": "bandwidth", **base, "read_gb_s": round(bandwidth / 1e9, 2),
                      "reads_gb_s": [round(before / 1e9, 2), round(after / 1e9, 2)],
                      "weight_bytes_per_token": weights, "limit_tok_s": round(limit, 2)}), flush=True)
    for line in lines:
        print(json.dumps({**base, **line}), flush=True)
    for share in shares(lines, limit):
        print(json.dumps({"part": "share", **base, **share}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rungs", help=f"comma-separated, of {', '.join(RUNGS)} or config.json paths "
                                        "(default: smollm2-1.7b, none with --gguf)")
    parser.add_argument("--gguf", default="", help="comma-separated GGUF files of one's own: the decode part on each")
    parser.add_argument("--tokenizer", help="with --gguf: a tokenizer folder (default: each file's own)")
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument("--peer-python", required=True, help="python of the llama-cpp venv (setup_llama_cpp.sh)")
    parser.add_argument("--vllm-venv", help="vLLM's venv for the trace (default: peer_bench.py's)")
    parser.add_argument("--vllm-dtype", default="bfloat16",
                        help="vLLM's dtype in the trace: bfloat16 (as its CPU users run it where the CPU has "
                             "AVX512-BF16 or AMX); float32 on an AVX2-only CPU, where its bf16 is emulated and "
                             "a real-size prefill step outlasts any fair comparison")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--num-requests", type=int, default=128)
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    formats = [f for f in args.formats.split(",") if f]
    try:
        specs = args.rungs if args.rungs is not None else ("" if args.gguf else "smollm2-1.7b")
        rungs = [resolve_rung(spec) for spec in specs.split(",") if spec]
    except ValueError as exc:
        raise SystemExit(str(exc)) from exc
    for path in (p for p in args.gguf.split(",") if p):
        decode_with_share(args, {"file": path}, path, args.tokenizer)
    for rung in rungs:
        files = make_rung(rung, args.peer_python, formats, seed=0, threads=args.threads, hf="trace" in parts)
        for fmt in formats:
            base = {"rung": rung.name, "format": fmt, "params": rung.params}
            if "decode" in parts:
                decode_with_share(args, base, files[fmt], files["tokenizer"])
            if "trace" in parts:
                for line in trace(args, files["hf"], files[fmt]):
                    print(json.dumps({**base, **{k: v for k, v in line.items() if k != "config"}}), flush=True)


if __name__ == "__main__":
    main()
