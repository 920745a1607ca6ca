"""The `pagedserve` command. Each subcommand lives in its own module, imported only when that
subcommand runs (so `pagedserve gateway` never imports torch); the imports are plain statements
in the loader functions below, so the import graph and the type checker see them. A module
provides `add_arguments(parser)` and `run(args) -> int`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Protocol

from common.log import configure_logging


class Subcommand(Protocol):
    """What a subcommand module provides."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    def run(self, args: argparse.Namespace) -> int | None: ...


def _up() -> Subcommand:
    from pagedserve.launch import up

    return up


def _switch_master() -> Subcommand:
    from pagedserve.launch import switch_master

    return switch_master


def _engine() -> Subcommand:
    from engine.worker import cli

    return cli


def _gateway() -> Subcommand:
    from gateway import cli

    return cli


def _fetch_model() -> Subcommand:
    from engine.model import fetch

    return fetch


def _simulate() -> Subcommand:
    from pagedserve.sim import cli

    return cli


def _plan() -> Subcommand:
    from pagedserve.plan import planner

    return planner


def _bench() -> Subcommand:
    from gateway.clients import bench

    return bench


def _chat() -> Subcommand:
    from gateway.clients import chat

    return chat


COMMANDS: dict[str, tuple[Callable[[], Subcommand], str]] = {
    "up": (_up, "run redis + engine + gateway on this machine (default model, port 8000)"),
    "engine": (_engine, "run an engine worker consuming the Redis request stream"),
    "gateway": (_gateway, "run the OpenAI-compatible HTTP gateway"),
    "switch-master": (_switch_master, "move a Redis master (Sentinel-managed, or a cluster's) to a replica on "
                                      "purpose, no write lost"),
    "fetch-model": (_fetch_model, "download the default model (SmolLM2-135M-Instruct)"),
    "simulate": (_simulate, "replay a request trace through contiguous and paged KV allocators"),
    "plan": (_plan, "KV-cache capacity arithmetic: blocks and max concurrency"),
    "bench": (_bench, "serving benchmark against a running gateway"),
    "chat": (_chat, "terminal streaming chat client"),
}


def _top_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description="PagedAttention LLM inference server")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        parser = _top_parser()
        if not argv:
            parser.print_help()
            return 2
        parser.parse_args(argv)  # prints usage and exits 2 for unknown commands, 0 for --help
        return 2
    name = argv[0]
    load, help_text = COMMANDS[name]
    module = load()
    parser = argparse.ArgumentParser(prog=f"pagedserve {name}", description=help_text)
    parser.add_argument("--log-json", action="store_true", help="log JSON lines instead of console text")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR")
    module.add_arguments(parser)
    args = parser.parse_args(argv[1:])
    configure_logging(json=args.log_json, level=args.log_level)
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
