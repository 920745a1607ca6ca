"""structlog configured in one place: a console renderer for people, JSON lines with a flag."""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog


def configure_logging(json: bool = False, level: str = "INFO") -> None:
    """Route every pagedserve log line through structlog, to stderr."""
    renderer: Any = (
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        # Look sys.stderr up at every write: it may be swapped after configuration (pytest's
        # capture, a daemonized child), and a logger bound to the old one would write to a
        # closed file.
        logger_factory=_current_stderr_logger,
        cache_logger_on_first_use=False,
    )


def get_logger(name: str) -> Any:
    """A bound structlog logger carrying the component name."""
    return structlog.get_logger(component=name)


def _current_stderr_logger(*_args: Any) -> structlog.PrintLogger:
    return structlog.PrintLogger(file=sys.stderr)
