"""`pagedserve gateway`: run the OpenAI-compatible HTTP gateway."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from common.log import get_logger
from common.protocol import DEFAULT_PREFIX, REASONING_PARSER_NAMES
from common.redis_spec import add_redis_arguments, spec_from_args
from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.serve import serve

log = get_logger("gateway")


def _model_spec(value: str) -> tuple[str, str]:
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError("expected NAME=TOKENIZER_DIR")
    return name, path


def _reasoning_spec(value: str) -> tuple[str, str]:
    """``PARSER`` (every model) or ``MODEL=PARSER``."""
    model, sep, name = value.rpartition("=")
    if (sep and not model) or name not in (*REASONING_PARSER_NAMES, "none"):
        raise argparse.ArgumentTypeError(f"expected [MODEL=]PARSER, PARSER one of {[*REASONING_PARSER_NAMES, 'none']}")
    return model, name


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = GatewayConfig()
    parser.add_argument("--host", default=defaults.host, help="listen address (default %(default)s)")
    parser.add_argument("--port", type=int, default=defaults.port, help="listen port (default %(default)s)")
    add_redis_arguments(parser, defaults.redis_url)
    parser.add_argument("--redis-prefix", default=DEFAULT_PREFIX, help="key prefix (default %(default)s)")
    parser.add_argument("--api-key", action="append", default=[], dest="api_keys",
                        help="accept this Bearer key (repeatable; also $PAGEDSERVE_API_KEYS, comma-separated); "
                             "none = no auth")
    parser.add_argument("--model", action="append", default=[], type=_model_spec, dest="models",
                        metavar="NAME=TOKENIZER_DIR",
                        help="tokenizer directory for a model name (repeatable); by default the gateway "
                             "uses the directory each engine announces in its heartbeat")
    parser.add_argument("--reasoning-parser", action="append", default=[], type=_reasoning_spec,
                        dest="reasoning_parsers", metavar="[MODEL=]PARSER",
                        help="split the thinking of a model (or of every model) into reasoning_content: deepseek_r1, "
                             "qwen3, gpt_oss, or none (repeatable; default: what the engine announces, else what "
                             "the chat template implies)")
    parser.add_argument("--max-body-bytes", type=int, default=defaults.max_body_bytes)
    parser.add_argument("--max-n", type=int, default=defaults.max_n)
    parser.add_argument("--max-tokens-limit", type=int, default=defaults.max_tokens_limit)
    parser.add_argument("--request-timeout", type=float, default=defaults.request_timeout_s,
                        help="seconds before a request fails with 504 (default %(default)s)")
    parser.add_argument("--gateway-id", default=None, help="id of this replica (default: random)")
    parser.add_argument("--redis-pool-size", type=int, default=defaults.redis_pool_size,
                        help="Redis connections of this gateway (default %(default)s)")
    parser.add_argument("--redis-pool-timeout", type=float, default=defaults.redis_pool_timeout_s,
                        help="seconds a request waits for a free Redis connection before a 429 (default %(default)s)")
    parser.add_argument("--redis-pool", choices=("blocking", "plain"), default=defaults.redis_pool,
                        help=argparse.SUPPRESS)  # "plain": the pre-issue-13 pool, for benchmarks
    parser.add_argument("--max-queued", type=int, default=defaults.max_queued_per_model,
                        help="requests waiting or running per model before new ones get 429 (default %(default)s)")
    parser.add_argument("--sse-keepalive", type=float, default=defaults.sse_keepalive_s, metavar="SECONDS",
                        help="send an SSE comment frame on a stream idle this long, for proxies that cut idle "
                             "connections (default 0 = never: some SSE clients mis-parse comments)")
    parser.add_argument("--write-timeout", type=float, default=defaults.write_timeout_s, metavar="SECONDS",
                        help="abort a request whose client reads nothing for this long (default %(default)s)")
    parser.add_argument("--drain-timeout", type=float, default=30.0, metavar="SECONDS",
                        help="on SIGTERM, stop listening (new connections are refused) and let open requests "
                             "run this long before they end with an error (a second signal exits at once; "
                             "default %(default)s)")
    parser.add_argument("--reuse-port", action="store_true",
                        help="bind with SO_REUSEPORT, so a new gateway can listen on the same port while this "
                             "one drains")
    parser.add_argument("--routing", choices=("on", "off"), default="on" if defaults.routing else "off",
                        help="cache-aware routing: send each request to the engine holding the longest cached "
                             "prefix of its prompt (off: every engine of a model reads one shared stream; "
                             "default %(default)s)")
    parser.add_argument("--route-load-slack", type=float, default=defaults.route_load_slack, metavar="REQUESTS",
                        help="route by load instead when the best-matching engine has more than this many "
                             "requests (waiting + running) above the least loaded one (default %(default)s)")
    parser.add_argument("--rate-limits", default=None, metavar="FILE",
                        help="per-API-key requests and tokens per minute, shared by all gateways through Redis "
                             "(JSON, or TOML for *.toml; reloaded on change and on SIGHUP; default: no limits)")
    parser.add_argument("--responses-ttl", type=int, default=defaults.responses_ttl_s, metavar="SECONDS",
                        help="keep each /v1/responses response (store: true) this long in Redis, for "
                             "previous_response_id and GET /v1/responses/{id} on any gateway; 0 = never store "
                             "(default %(default)s)")
    parser.add_argument("--responses-max-bytes", type=int, default=defaults.responses_max_bytes, metavar="BYTES",
                        help="largest stored response with its conversation, as JSON; a larger one is not "
                             "stored and says store: false (default %(default)s)")


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    keys = list(args.api_keys) + [k for k in os.environ.get("PAGEDSERVE_API_KEYS", "").split(",") if k]
    extra = {"gateway_id": args.gateway_id} if args.gateway_id else {}
    return GatewayConfig(
        host=args.host, port=args.port, redis_url=args.redis_url, redis=spec_from_args(args),
        redis_prefix=args.redis_prefix,
        api_keys=tuple(keys), models=tuple(args.models), max_body_bytes=args.max_body_bytes, max_n=args.max_n,
        max_tokens_limit=args.max_tokens_limit, request_timeout_s=args.request_timeout,
        redis_pool_size=args.redis_pool_size, redis_pool_timeout_s=args.redis_pool_timeout,
        max_queued_per_model=args.max_queued, redis_pool=args.redis_pool,
        sse_keepalive_s=args.sse_keepalive, write_timeout_s=args.write_timeout,
        routing=args.routing == "on", route_load_slack=args.route_load_slack,
        rate_limits_path=args.rate_limits, responses_ttl_s=args.responses_ttl,
        responses_max_bytes=args.responses_max_bytes, reasoning_parsers=tuple(args.reasoning_parsers), **extra,
    )


def run(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
        app = create_app(config)  # a bad --rate-limits file: refuse to start
    except ValueError as exc:
        print(f"pagedserve gateway: error: {exc}", file=sys.stderr)
        return 2
    log.info("starting gateway", host=config.host, port=config.port, redis=config.redis_spec.describe(),
             gateway_id=config.gateway_id, auth=bool(config.api_keys),
             rate_limits=config.rate_limits_path)
    return asyncio.run(serve(app, config.host, config.port, args.drain_timeout, args.reuse_port))
