"""`pagedserve engine`: run one engine worker on the Redis request stream."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from redis.exceptions import RedisError

from common.log import get_logger
from common.protocol import DEFAULT_PREFIX, REASONING_PARSER_NAMES
from common.redis_spec import add_redis_arguments, spec_from_args
from common.sizes import parse_size
from engine.config import DTYPES, KV_CACHE_DTYPES, PREEMPTION_MODES, QUANTIZATIONS, RUNNERS, EngineConfig

if TYPE_CHECKING:
    from engine.worker.engine_worker import EngineWorker

log = get_logger("worker")


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """CLI options of `pagedserve engine`."""
    parser.add_argument("--model", help="Hugging Face model directory or .gguf file (default: SmolLM2-135M-Instruct, "
                                         "fetched: its Q4_1 GGUF; the fp32 directory with --quantization dequantize)")
    parser.add_argument("--tokenizer", help="tokenizer directory (default: the model directory; for a .gguf the "
                                            "directory beside it, else the file's own tokenizer)")
    parser.add_argument("--quantization", default="auto", choices=QUANTIZATIONS,
                        help="a .gguf's tensors: auto serves them in their own formats (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/"
                             "IQ4_NL/MXFP4 and the K-quants Q2_K/Q3_K/Q4_K/Q5_K/Q6_K/IQ4_XS read in place; a format "
                             "without a kernel dequantized to fp32); "
                             "requantize serves those as Q8_0 (4x less memory, the packed kernels); dequantize "
                             "converts every tensor to --dtype at load")
    parser.add_argument("--served-model-name", help="model name clients ask for (default: the directory name; "
                                                    "for a .gguf the directory beside it when it holds the tokenizer, "
                                                    "else the file name without .gguf)")
    parser.add_argument("--reasoning-parser", choices=(*REASONING_PARSER_NAMES, "none"),
                        help="announced to gateways: how they split the model's thinking (reasoning_content) from "
                             "its answer (content); none: never (default: what the chat template implies, if any)")
    add_redis_arguments(parser)
    parser.add_argument("--redis-prefix", default=DEFAULT_PREFIX, help="key prefix of streams and channels")
    parser.add_argument("--engine-id", help="consumer name in group 'engines' (default: host-pid)")
    parser.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port")
    parser.add_argument("--metrics-host", default="0.0.0.0")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--dtype", default="auto", choices=DTYPES,
                        help="model dtype; auto: bf16 on CUDA and on CPUs with native bf16, else fp32")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                        help="KV cache dtype; auto: the model dtype; int8: per-row quantized, 1.94x the tokens "
                             "of bf16 at head 64")
    parser.add_argument("--block-size", type=int, default=16, choices=(8, 16, 32), help="tokens per KV block")
    parser.add_argument("--kv-cache-memory", type=_size, default=_size("1GiB"),
                        help="KV-cache bytes on the CPU, e.g. 512MiB (CUDA sizes from free memory)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--swap-space", type=_size, default=_size("1GiB"), help="host bytes for swapped blocks")
    parser.add_argument("--preemption-mode", default="auto", choices=PREEMPTION_MODES)
    parser.add_argument("--no-prefix-caching", action="store_true", help="disable automatic prefix caching")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int,
                        help="tokens per step (default: 1024 on the CPU, 2048 on CUDA)")
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--attention-backend", default="auto", choices=("auto", "reference"))
    parser.add_argument("--debug-blocks", action="store_true", help="log every block event, check invariants")
    parser.add_argument("--no-logit-screen", action="store_true",
                        help="greedy rows use the full fp32 lm_head even where the CPU has bf16 dot products "
                             "(the tokens are the same; the screen is faster)")
    parser.add_argument("--no-deterministic", action="store_true",
                        help="fastest CPU kernel per step size instead of one arithmetic per row (a request's "
                             "tokens and logprobs may then depend on its batch, chunking and preemption)")
    parser.add_argument("--int8-prompt-activations", action="store_true",
                        help="quantized weights: prompt rows on int8 activations like decode rows (1.4-1.6x "
                             "faster prefill on Q4 weights; the first token and prompt logprobs may then differ "
                             "from the dequantized model's at near-ties; default: fp32 prompt rows)")
    parser.add_argument("--speculative-config", type=_json_object,
                        help='speculative decoding, vLLM\'s JSON form, e.g. \'{"method": "ngram", '
                             '"num_speculative_tokens": 4, "prompt_lookup_max": 4}\' (default: off)')
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                        help="ranks this engine spawns on this machine, each holding 1/N of the heads "
                             "(gloo on the CPU, NCCL on CUDA: one GPU per rank, from --device on)")
    parser.add_argument("--tensor-parallel-timeout", type=float, default=30.0,
                        help="seconds a collective waits for a rank before the engine exits (default %(default)s)")
    parser.add_argument("--tensor-parallel-threads", type=int,
                        help="torch threads per rank (default: this process's threads / N)")
    parser.add_argument("--master-addr", default="127.0.0.1", help="where the ranks meet (default %(default)s)")
    parser.add_argument("--master-port", type=int, help="the ranks' rendezvous port (default: a free one)")
    parser.add_argument("--grammar-compile-timeout", type=_positive_seconds, default=10.0,
                        help="seconds a request's grammar (guided_choice, regex, JSON schema) may take to compile, "
                             "off the step path, before the request is refused with a 400 (default %(default)s)")
    parser.add_argument("--runner", default="auto", choices=RUNNERS,
                        help="pooling serves /v1/embeddings from the model's final hidden states (any served "
                             "architecture, a generative one too); auto: pooling for an embedding model's folder "
                             "(an architecture without LM head such as Qwen3Model, or a sentence-transformers "
                             "modules.json), else generate")
    parser.add_argument("--pooling-type", choices=("LAST", "MEAN", "CLS"),
                        help="with the pooling runner: last token, mean of the prompt or first token (default: "
                             "the folder's sentence-transformers pooling config, else LAST)")
    parser.add_argument("--heartbeat-interval", type=float, default=1.0,
                        help="seconds between heartbeats; a silent engine's requests move after 5 intervals")
    parser.add_argument("--max-claims", type=int, default=3,
                        help="a request taken over more often goes to the dead-letter stream (default %(default)s)")
    parser.add_argument("--drain-timeout", type=float, default=30.0,
                        help="after SIGTERM, seconds to finish running requests before handing the rest back "
                             "to the stream (default %(default)s)")
    parser.add_argument("--gateway-grace", type=float, default=30.0,
                        help="seconds a gateway's liveness key may stay gone (a pause, a cut to Redis) before its "
                             "requests are stopped, each with an error record for the gateway (default %(default)s)")
    parser.add_argument("--redis-pool-size", type=int, default=16, help="Redis connections (default %(default)s)")
    parser.add_argument("--no-routing", action="store_true",
                        help="read only the model's shared request stream and do not announce a routed stream "
                             "(no cache-aware routing to this engine, no work stealing)")
    parser.add_argument("--steal-after", type=_positive_seconds, default=3.0,
                        help="with routing: take entries that waited this many seconds (by Redis' clock) on a peer "
                             "engine's routed stream while this one has room (default %(default)s)")
    add_lora_arguments(parser)


def add_lora_arguments(parser: argparse.ArgumentParser) -> None:
    """vLLM's LoRA flags (`pagedserve engine` and `pagedserve up`)."""
    parser.add_argument("--enable-lora", action="store_true",
                        help="serve LoRA adapters over the model (requests pick one by its name as `model`)")
    parser.add_argument("--lora-modules", nargs="+", type=lora_module, default=[], metavar="NAME=PATH",
                        help="LoRA adapters served from start-up: NAME=PATH (a PEFT folder) or the JSON form "
                             '{"name": ..., "path": ..., "base_model_name": ...}')
    parser.add_argument("--max-loras", type=int, default=1,
                        help="distinct LoRA adapters in one step (the model's adapter slots; default %(default)s)")
    parser.add_argument("--max-cpu-loras", type=int,
                        help="LoRA adapters kept read in host memory, least recently used dropped "
                             "(default: --max-loras)")
    parser.add_argument("--max-lora-rank", type=int, default=16,
                        help="the largest LoRA rank served; each slot is sized for it (default %(default)s)")


def lora_flags(args: argparse.Namespace) -> list[str]:
    """The LoRA flags of `args` as `pagedserve engine` arguments (`pagedserve up` passes them on)."""
    flags = ["--enable-lora"] if args.enable_lora else []
    if args.lora_modules:
        flags += ["--lora-modules", *(f"{name}={os.path.abspath(path)}" for name, path in args.lora_modules)]
    flags += ["--max-loras", str(args.max_loras), "--max-lora-rank", str(args.max_lora_rank)]
    return flags + (["--max-cpu-loras", str(args.max_cpu_loras)] if args.max_cpu_loras is not None else [])


def lora_module(text: str) -> tuple[str, str]:
    """`(name, path)` of a `--lora-modules` entry: NAME=PATH, or a JSON object with name and path."""
    if text.lstrip().startswith("{"):
        try:
            value = json.loads(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"not JSON: {exc}") from exc
        if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not isinstance(
                value.get("path"), str) or not value["name"] or not value["path"]:
            raise argparse.ArgumentTypeError('expected {"name": "...", "path": "..."}')
        return value["name"], value["path"]
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {text!r}")
    return name, path


def engine_config(args: argparse.Namespace, model: str, tokenizer: str | None = None) -> EngineConfig:
    return EngineConfig(
        model=model, tokenizer=tokenizer, quantization=args.quantization,
        device=args.device, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
        block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory, gpu_memory_utilization=args.gpu_memory_utilization,
        swap_space=args.swap_space, preemption_mode=args.preemption_mode,
        enable_prefix_caching=not args.no_prefix_caching, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        attention_backend=args.attention_backend, debug_blocks=args.debug_blocks,
        logit_screen=not args.no_logit_screen, exact_prompt_rows=not args.int8_prompt_activations,
        deterministic=not args.no_deterministic,
        speculative_config=args.speculative_config,
        tensor_parallel_size=args.tensor_parallel_size, tensor_parallel_timeout=args.tensor_parallel_timeout,
        tensor_parallel_threads=args.tensor_parallel_threads, master_addr=args.master_addr,
        master_port=args.master_port, grammar_compile_timeout=args.grammar_compile_timeout,
        enable_lora=args.enable_lora, lora_modules=dict(args.lora_modules) or None, max_loras=args.max_loras,
        max_cpu_loras=args.max_cpu_loras, max_lora_rank=args.max_lora_rank,
        runner=args.runner, pooling_type=args.pooling_type,
    )


def resolve_model(model: str | None, tokenizer: str | None = None,
                  quantization: str = "auto") -> tuple[str, str | None]:
    """(model, tokenizer): `--model` as given, else the default model, fetched with progress: its
    Q4_1 GGUF (tokenizer from the directory beside it), or with `dequantize` the fp32 directory."""
    if model:
        return model, tokenizer
    from engine.model.fetch import default_model_dir

    directory = default_model_dir(progress=True)
    if quantization == "dequantize":
        return str(directory), tokenizer
    from engine.model.fetch import GGUF_NAME

    return str(directory / GGUF_NAME), tokenizer or str(directory)


def served_name(model: str) -> str:
    """The name clients ask for when none is given: a directory's name; for a .gguf, the name of
    the directory beside it when that holds its tokenizer (`fetch-model`'s layout), else its stem."""
    path = Path(model)
    if path.suffix != ".gguf":
        return path.name
    if (path.parent / "tokenizer.json").is_file():
        return path.parent.name
    return path.stem


async def _serve(worker: EngineWorker) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):  # drain: finish or hand back running requests
        loop.add_signal_handler(sig, worker.stop.set)
    try:
        await worker.run()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(ValueError, RuntimeError):
                loop.remove_signal_handler(sig)


def run(args: argparse.Namespace) -> int:
    """Start the worker; exit 0 on SIGINT/SIGTERM, 1 with one line on a startup error."""
    from engine.model.fetch import FetchError
    from engine.worker.engine_worker import EngineWorker, WorkerConfig

    try:
        model, tokenizer = resolve_model(args.model, args.tokenizer, args.quantization)
        config = engine_config(args, model, tokenizer)
        redis_spec = spec_from_args(args)
    except (FetchError, ValueError) as exc:
        print(f"pagedserve engine: error: {exc}", file=sys.stderr)
        return 1
    worker = EngineWorker(WorkerConfig(
        engine_id=args.engine_id or f"{socket.gethostname()}-{os.getpid()}",
        model_name=args.served_model_name or served_name(model),
        redis_url=args.redis_url, redis=redis_spec, redis_prefix=args.redis_prefix, metrics_host=args.metrics_host,
        metrics_port=args.metrics_port, heartbeat_interval_s=args.heartbeat_interval, max_claims=args.max_claims,
        drain_timeout_s=args.drain_timeout, redis_pool_size=args.redis_pool_size, gateway_grace_s=args.gateway_grace,
        routing=not args.no_routing, steal_after_s=args.steal_after, reasoning_parser=args.reasoning_parser or "",
    ), config)
    try:
        asyncio.run(_serve(worker))
    except (OSError, ValueError, RedisError) as exc:
        print(f"pagedserve engine: error: {exc}", file=sys.stderr)
        return 1
    return 0


def _positive_seconds(text: str) -> float:
    """A positive number of seconds from the command line."""
    try:
        value = float(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from exc
    if not value > 0:
        raise argparse.ArgumentTypeError("must be > 0")
    return value


def _json_object(text: str) -> dict[str, Any]:
    """A JSON object from the command line."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value
