"""structlog set-up, done once by the CLI (library code only calls ``structlog.get_logger``)."""

from __future__ import annotations

import logging
import os
import sys
from typing import Literal

import structlog

__all__ = ["FORMAT_ENV", "LEVEL_ENV", "LOG_LEVELS", "TRACE_CHOICES", "TRACE_HELP", "configure_logging",
           "configure_worker_logging", "export_log_config", "version_line"]

LogFormat = Literal["console", "json"]
LOG_LEVELS = ("debug", "info", "warning", "error")
#: how stead's own log lines look in the processes a command starts (agents, workers)
FORMAT_ENV, LEVEL_ENV = "STEAD_LOG_FORMAT", "STEAD_LOG_LEVEL"
TRACE_CHOICES = ("console", "otlp", "none")
TRACE_HELP = ("where recovery traces go: console (one summary line per recovery), otlp (OpenTelemetry's OTLP "
              "exporter, configured by the standard OTEL_EXPORTER_OTLP_* variables; pip install 'stead[otlp]'), "
              "or none; default: as OTEL_TRACES_EXPORTER says, otlp when OTEL_EXPORTER_OTLP_ENDPOINT is set, "
              "else none")


def version_line() -> str:
    """``stead 0.1.0 (torch 2.13.0, Python 3.11.2)``, torch's version read without importing it."""
    from importlib import metadata

    def version(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    return f"stead {version('stead')} (torch {version('torch')}, Python {sys.version.split()[0]})"


def export_log_config(fmt: str, level: str) -> None:
    """Let the processes this one starts (agents, workers) log stead's lines the same way."""
    os.environ[FORMAT_ENV] = fmt
    os.environ[LEVEL_ENV] = level


def configure_worker_logging() -> None:
    """In a worker: stead's own lines as the command that started the job asked, unless the script set structlog up."""
    fmt = os.environ.get(FORMAT_ENV)
    if fmt in ("console", "json") and not structlog.is_configured():
        configure_logging(fmt, level=os.environ.get(LEVEL_ENV, "info"))  # type: ignore[arg-type]


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
        logger_factory=structlog.WriteLoggerFactory(file=sys.stderr),  # a line and its newline in one write
        cache_logger_on_first_use=False,
    )
