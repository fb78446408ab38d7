"""structlog set-up, done once by the CLI (library code only calls ``structlog.get_logger``)."""

from __future__ import annotations

import logging
import sys
from typing import Literal

import structlog

__all__ = ["configure_logging"]

LogFormat = Literal["console", "json"]


def configure_logging(fmt: LogFormat = "console", *, level: str = "info") -> None:
    """Key-value logs to stderr: coloured console lines, or one JSON object per line."""
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        numeric = logging.INFO
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer()
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=False),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info if fmt == "json" else structlog.dev.set_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
