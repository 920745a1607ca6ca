"""The `pagedserve` command. Each subcommand lives in its own module, imported only when used
(so `pagedserve gateway` never imports torch). A module provides `add_arguments(parser)` and
`run(args) -> int`."""

from __future__ import annotations

import argparse
import importlib
import sys

from engine.log import configure_logging

COMMANDS: dict[str, tuple[str, str]] = {
    "up": ("engine.launch.up", "run redis + engine + gateway on this machine (default model, port 8000)"),
    "engine": ("engine.worker.cli", "run an engine worker consuming the Redis request stream"),
    "gateway": ("gateway.cli", "run the OpenAI-compatible HTTP gateway"),
    "fetch-model": ("engine.model.fetch", "download and convert the default model (SmolLM2-135M-Instruct)"),
    "simulate": ("engine.sim.cli", "replay a request trace through contiguous and paged KV allocators"),
    "plan": ("engine.plan.planner", "KV-cache capacity arithmetic: blocks and max concurrency"),
    "bench": ("gateway.clients.bench", "serving benchmark against a running gateway"),
    "chat": ("gateway.clients.chat", "terminal streaming chat client"),
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
    module = importlib.import_module(COMMANDS[name][0])
    parser = argparse.ArgumentParser(prog=f"pagedserve {name}", description=COMMANDS[name][1])
    parser.add_argument("--log-json", action="store_true", help="log JSON lines instead of console text")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR")
    module.add_arguments(parser)
    args = parser.parse_args(argv[1:])
    configure_logging(json=args.log_json, level=args.log_level)
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
