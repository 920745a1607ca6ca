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
from common.protocol import DEFAULT_PREFIX
from common.sizes import parse_size
from engine.config import DTYPES, PREEMPTION_MODES, EngineConfig

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
    parser.add_argument("--model", help="Hugging Face model directory (default: SmolLM2-135M-Instruct, fetched)")
    parser.add_argument("--served-model-name", help="model name clients ask for (default: the directory name)")
    parser.add_argument("--redis-url", default=os.environ.get("PAGEDSERVE_REDIS_URL", "redis://127.0.0.1:6379/0"))
    parser.add_argument("--redis-prefix", default=DEFAULT_PREFIX, help="key prefix of streams and channels")
    parser.add_argument("--engine-id", help="consumer name in group 'engines' (default: host-pid)")
    parser.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port")
    parser.add_argument("--metrics-host", default="0.0.0.0")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--dtype", default="auto", choices=DTYPES)
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
    parser.add_argument("--speculative-config", type=_json_object,
                        help='speculative decoding, vLLM\'s JSON form, e.g. \'{"method": "ngram", '
                             '"num_speculative_tokens": 4, "prompt_lookup_max": 4}\' (default: off)')
    parser.add_argument("--heartbeat-interval", type=float, default=1.0,
                        help="seconds between heartbeats; a silent engine's requests move after 5 intervals")
    parser.add_argument("--max-claims", type=int, default=3,
                        help="a request taken over more often goes to the dead-letter stream (default %(default)s)")
    parser.add_argument("--drain-timeout", type=float, default=30.0,
                        help="after SIGTERM, seconds to finish running requests before handing the rest back "
                             "to the stream (default %(default)s)")
    parser.add_argument("--redis-pool-size", type=int, default=16, help="Redis connections (default %(default)s)")


def engine_config(args: argparse.Namespace, model: str) -> EngineConfig:
    return EngineConfig(
        model=model, device=args.device, dtype=args.dtype, block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory, gpu_memory_utilization=args.gpu_memory_utilization,
        swap_space=args.swap_space, preemption_mode=args.preemption_mode,
        enable_prefix_caching=not args.no_prefix_caching, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        attention_backend=args.attention_backend, debug_blocks=args.debug_blocks,
        logit_screen=not args.no_logit_screen, speculative_config=args.speculative_config,
    )


def resolve_model(model: str | None) -> str:
    """`--model` as given, else the default model directory (fetched with progress)."""
    if model:
        return model
    from engine.model.fetch import default_model_dir

    return str(default_model_dir(progress=True))


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
        model = resolve_model(args.model)
        config = engine_config(args, model)
    except (FetchError, ValueError) as exc:
        print(f"pagedserve engine: error: {exc}", file=sys.stderr)
        return 1
    worker = EngineWorker(WorkerConfig(
        engine_id=args.engine_id or f"{socket.gethostname()}-{os.getpid()}",
        model_name=args.served_model_name or Path(model).name,
        redis_url=args.redis_url, redis_prefix=args.redis_prefix, metrics_host=args.metrics_host,
        metrics_port=args.metrics_port, heartbeat_interval_s=args.heartbeat_interval, max_claims=args.max_claims,
        drain_timeout_s=args.drain_timeout, redis_pool_size=args.redis_pool_size,
    ), config)
    try:
        asyncio.run(_serve(worker))
    except (OSError, ValueError, RedisError) as exc:
        print(f"pagedserve engine: error: {exc}", file=sys.stderr)
        return 1
    return 0


def _json_object(text: str) -> dict[str, Any]:
    """A JSON object from the command line."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value
