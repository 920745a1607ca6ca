"""`pagedserve up`: Redis + one engine + the gateway on this machine, one command.

Starts an embedded `redis-server` on a free loopback port (unless `--redis-url` or
`--redis-sentinel`: then the children follow the master the sentinels report), fetches the
default model on first run (with progress), then runs `pagedserve engine` and
`pagedserve gateway` as child processes in their own sessions. Ctrl-C (or SIGTERM) stops the
gateway, then the engine, then Redis."""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from types import FrameType

from common.log import get_logger
from common.redis_conn import redact_url
from common.redis_spec import parse_sentinels
from pagedserve.launch.redis_server import RedisServer, RedisServerError

log = get_logger("up")
GATEWAY_STOP_S = 45.0  # above the gateway's default --drain-timeout


class Stop(Exception):
    """SIGTERM / SIGINT received."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """CLI options of `pagedserve up`."""
    parser.add_argument("--port", type=int, default=8000, help="gateway port (default %(default)s)")
    parser.add_argument("--host", default="127.0.0.1", help="gateway address (default %(default)s)")
    parser.add_argument("--model", help="model directory or .gguf file (default: SmolLM2-135M-Instruct's Q4_1 GGUF, "
                                         "fetched on first run)")
    parser.add_argument("--tokenizer", help="tokenizer directory (default: the model's; see `pagedserve engine`)")
    parser.add_argument("--served-model-name", help="model name for clients (default: the directory name)")
    parser.add_argument("--quantization", default="auto", choices=("auto", "requantize", "dequantize"),
                        help="a .gguf's tensors: auto serves them as they are (default; formats without a kernel in "
                             "fp32), requantize serves those as Q8_0, dequantize converts them all (the default "
                             "model then runs its fp32 directory)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16", "int8"),
                        help="KV cache dtype (default %(default)s: int8 for a .gguf served quantized, 3.9x the "
                             "tokens of its fp32 cache; else the model dtype)")
    parser.add_argument("--redis-url", help="use this Redis instead of starting one")
    parser.add_argument("--redis-sentinel", metavar="HOST:PORT[,...]",
                        help="use the master these Redis Sentinels report (followed across failovers) instead of "
                             "starting a Redis")
    parser.add_argument("--redis-sentinel-master", default="mymaster", metavar="NAME",
                        help="the master's name in the sentinels' configuration (default %(default)s)")
    parser.add_argument("--redis-password", help="password of the Sentinel-managed master (passed on by environment)")
    parser.add_argument("--redis-sentinel-password", help="password of the sentinels (passed on by environment)")
    parser.add_argument("--redis-tls", action="store_true", help="TLS to the sentinels and the master")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--kv-cache-memory", default="1GiB", help="KV-cache bytes on the CPU (default %(default)s)")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                        help="ranks the engine splits the model over (see `pagedserve engine`; default 1)")
    parser.add_argument("--metrics-port", type=int, help="engine Prometheus port (gateway: /metrics)")
    parser.add_argument("--api-key", action="append", default=[], help="require this Bearer key (repeatable)")
    parser.add_argument("--rate-limits", metavar="FILE",
                        help="per-API-key requests/tokens per minute for the gateway (see `pagedserve gateway`; "
                             "reloaded when the file changes)")
    parser.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for /health")
    parser.add_argument("--sse-keepalive", type=float, default=0.0, metavar="SECONDS",
                        help="SSE comment frames on streams idle this long (default 0 = never)")
    parser.add_argument("--engine-args", default="", metavar="ARGS",
                        help="more `pagedserve engine` flags, one shell-quoted string, e.g. "
                             "\"--max-num-batched-tokens 512 --no-prefix-caching\"")
    parser.add_argument("--gateway-args", default="", metavar="ARGS",
                        help="more `pagedserve gateway` flags, e.g. \"--redis-pool-size 128 --max-queued 1000\"")


def _child(args: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    """`python -m pagedserve.cli ARGS` in its own session: Ctrl-C reaches only this process.
    Secrets (API keys, the Redis URL with its password) go by environment, never argv, which
    every user of the machine can read in `ps`."""
    return subprocess.Popen([sys.executable, "-m", "pagedserve.cli", *args], start_new_session=True,
                            env={**os.environ, **env})


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _stop(proc: subprocess.Popen[bytes], name: str, timeout: float = 15.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("killing", process=name)
            proc.kill()
            proc.wait()


def up_kv_cache_dtype(requested: str, model: str, quantization: str) -> str:
    """The KV cache dtype `up` runs: `requested`, except that "auto" for a .gguf served quantized
    (the default model) is int8 — with prompt rows on fp32 activations it states every fact the
    fp32 model does (tests/pagedserve/launch/test_up_default_answers.py), it decodes faster than the
    fp32 cache and holds 3.9x its tokens (docs/cpu-fast-path.md)."""
    if requested == "auto" and model.endswith(".gguf") and quantization in ("auto", "requantize"):
        return "int8"
    return requested


def _raise_stop(signum: int, frame: FrameType | None) -> None:
    raise Stop


def _wait_ready(url: str, children: dict[str, subprocess.Popen[bytes]], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not _healthy(url):
        for name, proc in children.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with code {proc.returncode} during startup")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the gateway at {url} was not healthy within {timeout:.0f}s")
        time.sleep(0.5)


def _banner(url: str, model: str, api_key: str | None) -> str:
    auth = f" -H 'Authorization: Bearer {api_key}'" if api_key else ""
    return (f"\npagedserve is up: {url}  (model '{model}')\n\n"
            f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\\n"
            f"    -d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}], "
            f"\"stream\": true}}'\n\nCtrl-C stops everything.\n")


def _sentinel_env(args: argparse.Namespace) -> dict[str, str]:
    """`--redis-sentinel*` options as the environment both children read (passwords never in argv)."""
    env: dict[str, str] = {"PAGEDSERVE_REDIS_SENTINEL": ""}  # not inherited from this process' environment
    if args.redis_sentinel:
        env |= {"PAGEDSERVE_REDIS_SENTINEL": args.redis_sentinel,
                "PAGEDSERVE_REDIS_SENTINEL_MASTER": args.redis_sentinel_master}
    if args.redis_password:
        env["PAGEDSERVE_REDIS_PASSWORD"] = args.redis_password
    if args.redis_sentinel_password:
        env["PAGEDSERVE_REDIS_SENTINEL_PASSWORD"] = args.redis_sentinel_password
    return env


def run(args: argparse.Namespace) -> int:
    """Start everything, print the URL, wait for Ctrl-C; exit 1 if a child dies."""
    from engine.model.fetch import FetchError
    from engine.worker.cli import resolve_model, served_name

    previous = signal.signal(signal.SIGTERM, _raise_stop)
    signal.signal(signal.SIGINT, _raise_stop)  # also when started with SIGINT ignored (background job)
    redis: RedisServer | None = None
    children: dict[str, subprocess.Popen[bytes]] = {}
    try:
        model, tokenizer = resolve_model(args.model, args.tokenizer, args.quantization)
        name = args.served_model_name or served_name(model)
        kv_cache_dtype = up_kv_cache_dtype(args.kv_cache_dtype, model, args.quantization)
        if kv_cache_dtype != args.kv_cache_dtype:
            log.info("kv cache dtype", kv_cache_dtype=kv_cache_dtype,
                     reason="a GGUF served quantized: int8 rows hold 3.9x the tokens of its fp32 cache and decode "
                            "faster (docs/cpu-fast-path.md); --kv-cache-dtype float32 for the model dtype")
        secrets = _sentinel_env(args)
        if args.redis_sentinel:
            parse_sentinels(args.redis_sentinel)  # a bad list fails here, once, not in both children
        elif args.redis_url:
            secrets["PAGEDSERVE_REDIS_URL"] = args.redis_url
        else:
            redis = RedisServer().start()
            secrets["PAGEDSERVE_REDIS_URL"] = redis.url
            log.info("redis started", url=redact_url(redis.url), binary=redis.binary)
        tls = ["--redis-tls"] if args.redis_tls else []
        engine_args = ["engine", "--model", model, "--served-model-name", name, "--quantization", args.quantization,
                       "--kv-cache-dtype", kv_cache_dtype, *(["--tokenizer", tokenizer] if tokenizer else []),
                       "--engine-id", "up-engine-0", "--device", args.device,
                       "--kv-cache-memory", args.kv_cache_memory, "--max-num-seqs", str(args.max_num_seqs),
                       "--tensor-parallel-size", str(args.tensor_parallel_size)]
        if args.metrics_port:
            engine_args += ["--metrics-port", str(args.metrics_port)]
        children["engine"] = _child(engine_args + tls + shlex.split(args.engine_args), secrets)
        gateway_args = ["gateway", "--host", args.host, "--port", str(args.port), *tls,
                        "--sse-keepalive", str(args.sse_keepalive),
                        *(["--rate-limits", os.path.abspath(args.rate_limits)] if args.rate_limits else []),
                        *shlex.split(args.gateway_args)]
        children["gateway"] = _child(gateway_args, secrets | (
            {"PAGEDSERVE_API_KEYS": ",".join(args.api_key)} if args.api_key else {}))
        host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
        url = f"http://{host}:{args.port}"
        _wait_ready(url, children, args.ready_timeout)
        print(_banner(url, name, args.api_key[0] if args.api_key else None), flush=True)
        while all(proc.poll() is None for proc in children.values()):
            time.sleep(0.5)
        dead = [f"{n} (code {p.returncode})" for n, p in children.items() if p.poll() is not None]
        print(f"pagedserve up: {', '.join(dead)} exited; stopping", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, Stop):
        print("\nstopping…", file=sys.stderr)
        return 0
    except (FetchError, RedisServerError, RuntimeError, ValueError) as exc:
        print(f"pagedserve up: error: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not interrupt the cleanup
        for child_name in ("gateway", "engine"):
            if child_name in children:
                # the gateway drains its open streams first (its --drain-timeout, 30 s by default)
                _stop(children[child_name], child_name, GATEWAY_STOP_S if child_name == "gateway" else 15.0)
        if redis is not None:
            redis.stop()
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, signal.default_int_handler)
