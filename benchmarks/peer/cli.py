"""Command-line options of benchmarks/peer/peer_bench.py; `--quick` scales every part down for a smoke run."""

from __future__ import annotations

import argparse

PART_NAMES = ("offline", "tiny", "single", "served")
QUICK = {"num_requests": 16, "repeats": 1, "tiny_seqs": 32, "tiny_output_len": 64, "single_output_len": 64,
         "single_repeats": 1, "served_prompts": 16, "served_output_len": 32, "served_concurrency": 4}


def _parts(text: str) -> list[str]:
    names = [p.strip() for p in text.split(",") if p.strip()]
    unknown = sorted(set(names) - set(PART_NAMES))
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"parts are {','.join(PART_NAMES)}; got {text!r}")
    return [p for p in PART_NAMES if p in names]  # always in the documented order


def build_parser(description: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--only", type=_parts, default=list(PART_NAMES), help="parts to run (default: all): " + ",".join(PART_NAMES))
    add("--quick", action="store_true", help="smoke run: every part small (" +
        ", ".join(f"{k}={v}" for k, v in QUICK.items()) + ")")
    add("--model", help="HF model directory (default: SmolLM2-135M-Instruct, fetched)")
    add("--pagedserve-model", help="offline/single/tiny: what pagedserve loads instead (e.g. the same weights' "
        "GGUF, served quantized); vLLM keeps --model")
    add("--vllm-dtype", default="float32", help="vLLM's dtype in the offline, single and served parts "
        "(bfloat16: what its CPU docs recommend; default %(default)s, the same weights as pagedserve's fp32)")
    add("--pagedserve-dtype", default="float32", help="offline/single: pagedserve's dtype (default %(default)s; "
        "auto: bf16 where the CPU computes bf16 natively; a GGUF served quantized computes in fp32 either way)")
    add("--pagedserve-kv-cache-dtype", default="auto", help="offline/single: pagedserve's KV cache dtype (default "
        "%(default)s = the model dtype; int8 is what `pagedserve up` serves a GGUF with)")
    add("--pagedserve-int8-prompt-activations", action="store_true", help="offline/single: pagedserve's prompt "
        "rows on int8 activations like decode rows (`pagedserve engine --int8-prompt-activations`)")
    add("--pagedserve-no-deterministic", action="store_true", help="offline/single: pagedserve without "
        "deterministic mode (`pagedserve engine --no-deterministic`: many-row steps may switch kernels by row count)")
    add("--kv-cache-gib", type=int, default=2, help="KV pool of both systems, GiB (default %(default)s)")
    add("--max-model-len", type=int, default=2048)
    add("--seed", type=int, default=0, help="trace seed (default %(default)s, as engine_bench.py)")
    add("--repeats", type=int, default=2, help="offline and tiny: timed runs per system in its one process, "
        "the fastest kept (default %(default)s)")
    add("--num-requests", type=int, default=128, help="offline: ShareGPT-like requests")
    add("--min-len", type=int, default=16, help="offline: shortest prompt / output")
    add("--max-len", type=int, default=256, help="offline: longest prompt / output")
    add("--tiny-seqs", type=int, default=256, help="tiny: sequences")
    add("--tiny-prompt-len", type=int, default=32, help="tiny: prompt tokens (random ids)")
    add("--tiny-output-len", type=int, default=256, help="tiny: output tokens per sequence")
    add("--single-prompt-len", type=int, default=32)
    add("--single-output-len", type=int, default=256, help="single: decoded tokens timed")
    add("--single-repeats", type=int, default=2, help="single: repeats, the fastest kept")
    add("--served-prompts", type=int, default=96)
    add("--served-input-len", type=int, default=128)
    add("--served-output-len", type=int, default=128)
    add("--served-concurrency", type=int, default=32, help="served: the bounded run's max concurrency")
    add("--served-systems", default="pagedserve,vllm", help="served: which servers to run (default %(default)s)")
    add("--pagedserve-args", default="", help="served: extra arguments of `pagedserve up`, one string, "
        "e.g. \"--engine-args '--max-num-batched-tokens 512'\"")
    add("--server-timeout", type=float, default=900.0, help="served: seconds a server may take to start")
    add("--vllm-venv", help="vLLM's virtualenv (default $VLLM_VENV, else the one setup_vllm.sh makes)")
    add("--log-dir", help="vLLM, server and client logs (default: a new temporary directory)")
    add("--json-out", help="also write the JSON lines to this file")
    return parser


def parse_args(description: str | None, argv: list[str] | None = None) -> argparse.Namespace:
    """Options; with --quick the QUICK sizes replace the defaults (sizes given explicitly still win)."""
    parser = build_parser(description)
    if parser.parse_args(argv).quick:
        parser.set_defaults(**QUICK)
    return parser.parse_args(argv)
