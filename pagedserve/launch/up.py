"""`pagedserve up`: Redis + one engine + the gateway on this machine, one command.

Starts an embedded `redis-server` on a free loopback port (unless `--redis-url`,
`--redis-sentinel`: then the children follow the master the sentinels report, or
`--redis-cluster`: then they use that Redis Cluster), fetches the
default model on first run (with progress), then runs `pagedserve engine` and
`pagedserve gateway` as child processes in their own sessions. Ctrl-C (or SIGTERM) stops the
gateway, then the engine, then Redis.

SIGHUP restarts the children one at a time, replacement first (`Stack.rolling_restart`): a new
engine (the other of two engine ids) until the gateway sees it consuming, then SIGTERM to the old
one, which drains and hands back what it still runs (resumed exactly by the new one); then a new
gateway on the same port (every gateway of `up` listens with `--reuse-port`) until it answers
/health itself, then SIGTERM to the old one, which drains its open streams to their end.

Several `up`s may share one Redis (a Sentinel group) and one port (`--reuse-port`): each with
its own `--name`, which names its engines; the fleet is then restarted one `up` at a time
(docs/deployment.md)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import FrameType
from typing import Any

from common.log import get_logger
from common.protocol import REASONING_PARSER_NAMES
from common.redis_conn import redact_url
from common.redis_spec import parse_cluster_nodes, parse_sentinels
from pagedserve.launch.redis_server import RedisServer, RedisServerError

log = get_logger("up")
GATEWAY_STOP_S = 45.0  # above the gateway's default --drain-timeout


class Stop(Exception):
    """SIGTERM / SIGINT received."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """CLI options of `pagedserve up`."""
    parser.add_argument("--port", type=int, default=8000, help="gateway port (default %(default)s)")
    parser.add_argument("--name", default="up", type=_stack_name,
                        help="names this stack's engines (NAME-engine-0, NAME-engine-1) and gateways; give each `up` "
                             "sharing one Redis its own (default %(default)s)")
    parser.add_argument("--host", default="127.0.0.1", help="gateway address (default %(default)s)")
    parser.add_argument("--model", help="model directory or .gguf file (default: SmolLM2-135M-Instruct's Q4_1 GGUF, "
                                         "fetched on first run)")
    parser.add_argument("--tokenizer", help="tokenizer directory (default: the model's; see `pagedserve engine`)")
    parser.add_argument("--served-model-name", help="model name for clients (default: the directory name)")
    parser.add_argument("--reasoning-parser", choices=(*REASONING_PARSER_NAMES, "none"),
                        help="split the model's thinking (reasoning_content) from its answer (content); none: never "
                             "(default: what the chat template implies, if any)")
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
    parser.add_argument("--redis-cluster", metavar="HOST:PORT[,...]",
                        help="use the Redis Cluster these nodes belong to (keys spread over its masters) instead of "
                             "starting a Redis")
    parser.add_argument("--redis-password", help="password of the Sentinel-managed master or the cluster's nodes "
                                                 "(passed on by environment)")
    parser.add_argument("--redis-sentinel-password", help="password of the sentinels (passed on by environment)")
    parser.add_argument("--redis-tls", action="store_true", help="TLS to the sentinels and the master")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--kv-cache-memory", default="1GiB", help="KV-cache bytes on the CPU (default %(default)s)")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                        help="ranks the engine splits the model over (see `pagedserve engine`; default 1)")
    parser.add_argument("--runner", default="auto", choices=("auto", "generate", "pooling"),
                        help="pooling serves /v1/embeddings instead of generation (see `pagedserve engine`; "
                             "default %(default)s: pooling for an embedding model's folder)")
    parser.add_argument("--pooling-type", choices=("LAST", "MEAN", "CLS"),
                        help="with the pooling runner: which rows are pooled (see `pagedserve engine`)")
    parser.add_argument("--metrics-port", type=int, help="engine Prometheus port (gateway: /metrics)")
    parser.add_argument("--api-key", action="append", default=[], help="require this Bearer key (repeatable)")
    parser.add_argument("--rate-limits", metavar="FILE",
                        help="per-API-key requests/tokens per minute for the gateway (see `pagedserve gateway`; "
                             "reloaded when the file changes)")
    parser.add_argument("--ready-timeout", type=float, default=600.0,
                        help="seconds to wait for /health (at start, and for each replacement in a rolling restart)")
    parser.add_argument("--sse-keepalive", type=float, default=0.0, metavar="SECONDS",
                        help="SSE comment frames on streams idle this long (default 0 = never)")
    from engine.worker.cli import add_lora_arguments

    add_lora_arguments(parser)
    parser.add_argument("--engine-args", default="", metavar="ARGS",
                        help="more `pagedserve engine` flags, one shell-quoted string, e.g. "
                             "\"--max-num-batched-tokens 512 --no-prefix-caching\"")
    parser.add_argument("--gateway-args", default="", metavar="ARGS",
                        help="more `pagedserve gateway` flags, e.g. \"--redis-pool-size 128 --max-queued 1000\"")


def _stack_name(text: str) -> str:
    """`--name`: letters, digits, '-' and '_' (it becomes part of engine and gateway ids)."""
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_-]{0,39}", text):
        raise argparse.ArgumentTypeError(f"{text!r}: use up to 40 letters, digits, '-' or '_'")
    return text


def _child(args: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    """`python -m pagedserve.cli ARGS` in its own session: Ctrl-C reaches only this process.
    Secrets (API keys, the Redis URL with its password) go by environment, never argv, which
    every user of the machine can read in `ps`."""
    return subprocess.Popen([sys.executable, "-m", "pagedserve.cli", *args], start_new_session=True,
                            env={**os.environ, **env})


def _health(url: str) -> dict[str, Any] | None:
    """/health's body when it answers 200, else None. Each call opens a new connection, so with
    several gateways on one SO_REUSEPORT port each call may reach another of them."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
            if resp.status != 200:
                return None
            body = json.loads(resp.read())
    except (urllib.error.URLError, OSError, ValueError):
        return None
    return body if isinstance(body, dict) else None


def _stop(proc: subprocess.Popen[bytes], name: str, timeout: float = 15.0) -> int:
    """SIGTERM, wait up to `timeout` (the child drains meanwhile), then SIGKILL; its exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("killing", process=name, after_s=timeout)
            proc.kill()
            proc.wait()
    return int(proc.returncode)


def _flag(argv: list[str], name: str, default: float) -> float:
    """The value of `name` (a number) in `argv`, the last one given; `default` if absent."""
    value = default
    for i, arg in enumerate(argv):
        text = arg.split("=", 1)[1] if arg.startswith(f"{name}=") else \
            argv[i + 1] if arg == name and i + 1 < len(argv) else None
        if text is not None:
            with contextlib.suppress(ValueError):  # the child refuses it at startup, with its own message
                value = float(text)
    return value


@dataclass
class Child:
    """One process `up` runs: an engine or a gateway, in slot 0 or 1 (its replacement takes the
    other slot, so the two never share an engine id, a gateway id or a metrics port)."""

    kind: str
    ident: str
    slot: int
    proc: subprocess.Popen[bytes]

    def describe(self) -> str:
        return f"{self.kind} {self.ident} (pid {self.proc.pid})"


class RestartFailed(RuntimeError):
    """A replacement did not come up; the process it was to replace still serves."""


class Stack:
    """The engine and the gateway `up` runs, how to start each again, and the rolling restart.
    `engine_argv` / `gateway_argv` are the children's arguments without their ids (and, for the
    engine, without its metrics port): a replacement is the same command in the other slot."""

    def __init__(self, engine_argv: list[str], gateway_argv: list[str], engine_env: dict[str, str],
                 gateway_env: dict[str, str], url: str, metrics_port: int | None, ready_timeout: float,
                 name: str = "up") -> None:
        self.engine_argv = engine_argv
        self.gateway_argv = gateway_argv
        self.engine_env = engine_env
        self.gateway_env = gateway_env
        self.url = url
        self.metrics_port = metrics_port
        self.ready_timeout = ready_timeout
        self.name = name  # engine ids: stable across restarts of `up`, distinct between stacks on one Redis
        self.tag = f"{name}{os.getpid()}"  # gateway ids unique per `up` process
        self.engine: Child | None = None
        self.gateway: Child | None = None
        self.starting: list[Child] = []  # replacements not yet serving (stopped too by stop_all)
        # how long a SIGTERMed child may take: its drain timeout and a margin (model-free shutdown)
        self.engine_stop_s = _flag(engine_argv, "--drain-timeout", 30.0) + 30.0
        self.gateway_stop_s = max(GATEWAY_STOP_S, _flag(gateway_argv, "--drain-timeout", 30.0) + 15.0)
        self.restarts = 0

    def start_engine(self, slot: int) -> Child:
        engine_id = f"{self.name}-engine-{slot}"
        argv = [*self.engine_argv, "--engine-id", engine_id]
        if self.metrics_port:
            argv += ["--metrics-port", str(self.metrics_port + slot)]
        child = Child("engine", engine_id, slot, _child(argv, self.engine_env))
        if self.engine is None:
            self.engine = child
        else:
            self.starting.append(child)
        return child

    def start_gateway(self, slot: int) -> Child:
        gateway_id = f"{self.tag}-gateway-{slot}"
        child = Child("gateway", gateway_id, slot,
                      _child([*self.gateway_argv, "--reuse-port", "--gateway-id", gateway_id], self.gateway_env))
        if self.gateway is None:
            self.gateway = child
        else:
            self.starting.append(child)
        return child

    def serving(self) -> list[Child]:
        return [c for c in (self.gateway, self.engine) if c is not None]

    def dead(self) -> list[Child]:
        """Serving children that exited on their own."""
        return [c for c in self.serving() if c.proc.poll() is not None]

    def wait_ready(self) -> None:
        """Until the gateway answers /health itself (on a port other `up`s share, another one may
        answer first) and sees the engine consuming (first start)."""
        engine, gateway = self.engine, self.gateway
        assert engine is not None and gateway is not None
        self._wait(gateway, "the gateway healthy with its engine",
                   lambda body: body.get("gateway") == gateway.ident and engine.ident in body.get("engine_ids", ()),
                   watch=[engine])

    def _wait(self, child: Child, what: str, condition: Callable[[dict[str, Any]], bool],
              watch: Iterable[Child] = ()) -> None:
        """Poll /health until a 200 body meets `condition`; RestartFailed if `child` (or one of
        `watch`) exits or `ready_timeout` passes."""
        deadline = time.monotonic() + self.ready_timeout
        while True:
            body = _health(self.url)
            if body is not None and condition(body):
                return
            for proc in (child, *watch):
                if proc.proc.poll() is not None:
                    raise RestartFailed(f"{proc.describe()} exited with code {proc.proc.returncode} while waiting "
                                        f"for {what}")
            if time.monotonic() > deadline:
                raise RestartFailed(f"timed out after {self.ready_timeout:.0f}s waiting for {what} (at {self.url})")
            time.sleep(0.2)

    def rolling_restart(self) -> bool:
        """Replace the engine, then the gateway, each replacement serving before the old one is
        stopped. False (logged) when a replacement did not come up: it is stopped and the old
        process keeps serving; the rest of the restart is skipped."""
        self.restarts += 1
        started = time.monotonic()
        log.info("rolling restart: begin", restart=self.restarts)
        try:
            self._replace_engine()
            self._replace_gateway()
        except RestartFailed as exc:
            log.error("rolling restart: failed; the old process keeps serving", reason=str(exc))
            for child in self.starting:
                _stop(child.proc, child.describe(), self.engine_stop_s)
            self.starting.clear()
            return False
        log.info("rolling restart: done", restart=self.restarts, seconds=round(time.monotonic() - started, 1))
        return True

    def _replace_engine(self) -> None:
        old = self.engine
        assert old is not None
        new = self.start_engine(1 - old.slot)
        log.info("rolling restart: engine replacement started", old=old.describe(), new=new.describe())
        self._wait(new, f"engine {new.ident} consuming",
                   lambda body: new.ident in body.get("engine_ids", ()), watch=[old])
        log.info("rolling restart: engine replacement ready; stopping the old engine (drain)", old=old.describe())
        self.engine = new
        self.starting.remove(new)
        code = _stop(old.proc, old.describe(), self.engine_stop_s)
        log.info("rolling restart: old engine exited", old=old.describe(), code=code)

    def _replace_gateway(self) -> None:
        old = self.gateway
        assert old is not None
        new = self.start_gateway(1 - old.slot)
        log.info("rolling restart: gateway replacement started", old=old.describe(), new=new.describe())
        self._wait(new, f"gateway {new.ident} healthy on {self.url}",
                   lambda body: body.get("gateway") == new.ident, watch=[old])
        log.info("rolling restart: gateway replacement healthy; stopping the old gateway (drain)",
                 old=old.describe())
        self.gateway = new
        self.starting.remove(new)
        code = _stop(old.proc, old.describe(), self.gateway_stop_s)
        log.info("rolling restart: old gateway exited", old=old.describe(), code=code)

    def stop_all(self) -> None:
        """Gateways first (they drain their open streams), then engines."""
        children = [*self.starting, *self.serving()]
        for child in sorted(children, key=lambda c: c.kind != "gateway"):
            _stop(child.proc, child.describe(), self.gateway_stop_s if child.kind == "gateway" else 15.0)
        self.starting.clear()


def up_kv_cache_dtype(requested: str, model: str, quantization: str) -> str:
    """The KV cache dtype `up` runs: `requested`, except that "auto" for a .gguf served quantized
    (the default model) is int8 — with prompt rows on fp32 activations it states every fact the
    fp32 model does (tests/pagedserve/launch/test_up_default_answers.py), it decodes faster than the
    fp32 cache and holds nearly four times its tokens (docs/cpu-fast-path.md)."""
    if requested == "auto" and model.endswith(".gguf") and quantization in ("auto", "requantize"):
        return "int8"
    return requested


def _raise_stop(signum: int, frame: FrameType | None) -> None:
    raise Stop


def _banner(url: str, model: str, api_key: str | None) -> str:
    auth = f" -H 'Authorization: Bearer {api_key}'" if api_key else ""
    return (f"\npagedserve is up: {url}  (model '{model}')\n\n"
            f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\\n"
            f"    -d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}], "
            f"\"stream\": true}}'\n\nCtrl-C stops everything.\n")


def _sentinel_env(args: argparse.Namespace) -> dict[str, str]:
    """`--redis-sentinel*` and `--redis-cluster` options as the environment both children read
    (passwords never in argv)."""
    # not inherited from this process' environment
    env: dict[str, str] = {"PAGEDSERVE_REDIS_SENTINEL": "", "PAGEDSERVE_REDIS_CLUSTER": ""}
    if args.redis_cluster:
        env["PAGEDSERVE_REDIS_CLUSTER"] = args.redis_cluster
    if args.redis_sentinel:
        env |= {"PAGEDSERVE_REDIS_SENTINEL": args.redis_sentinel,
                "PAGEDSERVE_REDIS_SENTINEL_MASTER": args.redis_sentinel_master}
    if args.redis_password:
        env["PAGEDSERVE_REDIS_PASSWORD"] = args.redis_password
    if args.redis_sentinel_password:
        env["PAGEDSERVE_REDIS_SENTINEL_PASSWORD"] = args.redis_sentinel_password
    return env


def run(args: argparse.Namespace) -> int:
    """Start everything, print the URL, wait for Ctrl-C (SIGHUP: a rolling restart); exit 1 if a
    child dies."""
    from engine.model.fetch import FetchError
    from engine.worker.cli import lora_flags, resolve_model, served_name

    hangups: list[int] = []
    previous = signal.signal(signal.SIGTERM, _raise_stop)
    signal.signal(signal.SIGINT, _raise_stop)  # also when started with SIGINT ignored (background job)
    previous_hup = signal.signal(signal.SIGHUP, lambda signum, frame: hangups.append(signum))
    redis: RedisServer | None = None
    stack: Stack | None = None
    try:
        model, tokenizer = resolve_model(args.model, args.tokenizer, args.quantization)
        name = args.served_model_name or served_name(model)
        kv_cache_dtype = up_kv_cache_dtype(args.kv_cache_dtype, model, args.quantization)
        if kv_cache_dtype != args.kv_cache_dtype:
            log.info("kv cache dtype", kv_cache_dtype=kv_cache_dtype,
                     reason="a GGUF served quantized: int8 rows hold 3.9x the tokens of its fp32 cache and decode "
                            "faster (docs/cpu-fast-path.md); --kv-cache-dtype float32 for the model dtype")
        secrets = _sentinel_env(args)
        if args.redis_sentinel and args.redis_cluster:
            raise ValueError("--redis-sentinel and --redis-cluster exclude each other")
        if args.redis_sentinel:
            parse_sentinels(args.redis_sentinel)  # a bad list fails here, once, not in both children
        elif args.redis_cluster:
            parse_cluster_nodes(args.redis_cluster)
        elif args.redis_url:
            secrets["PAGEDSERVE_REDIS_URL"] = args.redis_url
        else:
            redis = RedisServer().start()
            secrets["PAGEDSERVE_REDIS_URL"] = redis.url
            log.info("redis started", url=redact_url(redis.url), binary=redis.binary)
        tls = ["--redis-tls"] if args.redis_tls else []
        engine_args = ["engine", "--model", model, "--served-model-name", name, "--quantization", args.quantization,
                       "--kv-cache-dtype", kv_cache_dtype, *(["--tokenizer", tokenizer] if tokenizer else []),
                       "--device", args.device,
                       "--kv-cache-memory", args.kv_cache_memory, "--max-num-seqs", str(args.max_num_seqs),
                       "--tensor-parallel-size", str(args.tensor_parallel_size), "--runner", args.runner,
                       *(["--pooling-type", args.pooling_type] if args.pooling_type else []),
                       *(["--reasoning-parser", args.reasoning_parser] if args.reasoning_parser else []),
                       *lora_flags(args)]
        gateway_args = ["gateway", "--host", args.host, "--port", str(args.port), *tls,
                        "--sse-keepalive", str(args.sse_keepalive),
                        *(["--rate-limits", os.path.abspath(args.rate_limits)] if args.rate_limits else []),
                        *shlex.split(args.gateway_args)]
        host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
        url = f"http://{host}:{args.port}"
        stack = Stack(engine_args + tls + shlex.split(args.engine_args), gateway_args, secrets,
                      secrets | ({"PAGEDSERVE_API_KEYS": ",".join(args.api_key)} if args.api_key else {}),
                      url, args.metrics_port, args.ready_timeout, args.name)
        stack.start_engine(0)
        stack.start_gateway(0)
        stack.wait_ready()
        print(_banner(url, name, args.api_key[0] if args.api_key else None), flush=True)
        while not stack.dead():
            if hangups:
                hangups.clear()  # SIGHUPs during a restart ask for one more, not one each
                stack.rolling_restart()
                continue
            time.sleep(0.5)
        dead = [f"{c.describe()} (code {c.proc.returncode})" for c in stack.dead()]
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
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        if stack is not None:
            stack.stop_all()  # the gateway drains its open streams first (its --drain-timeout)
        if redis is not None:
            redis.stop()
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGHUP, previous_hup)
        signal.signal(signal.SIGINT, signal.default_int_handler)
