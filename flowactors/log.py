"""Structured logging: one structlog event per call (role, method, rank, step, duration), console or JSON.

Workers log through the same configuration: `configure_logging` sets environment variables that worker
processes started afterwards read (`FLOWACTORS_LOG`, `FLOWACTORS_LOG_LEVEL`), and `flowactors` configures itself
from them on import, so one call on the controller configures the whole embedded cluster. The per-call events
follow its level (`info_enabled`), not a structlog configuration made by other means.
"""

from __future__ import annotations

import logging
import os
import sys

import structlog

__all__ = ["configure_logging", "info_enabled"]

_INFO = False


class _CurrentStderr:
    """Writes to whatever `sys.stderr` is at write time, not the stream current when logging was configured: a
    replaced stderr (pytest's capture, a redirect) may be closed later, and events must not fail on it."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure_logging(renderer: str = "console", level: str = "warning") -> None:
    """Route structlog events to stderr as `console` (human) or `json` lines, at `level` and above."""
    if renderer not in ("console", "json"):
        raise ValueError(f"log renderer must be 'console' or 'json', got {renderer!r}")
    lvl = logging.getLevelName(level.upper())
    if not isinstance(lvl, int):
        raise ValueError(f"unknown log level {level!r}; use debug, info, warning or error")
    os.environ["FLOWACTORS_LOG"], os.environ["FLOWACTORS_LOG_LEVEL"] = renderer, level
    global _INFO
    _INFO = lvl <= logging.INFO
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.processors.JSONRenderer() if renderer == "json" else structlog.dev.ConsoleRenderer(colors=False),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(_CurrentStderr()),
        cache_logger_on_first_use=False,
    )


def configure_from_env() -> None:
    configure_logging(os.environ.get("FLOWACTORS_LOG", "console"), os.environ.get("FLOWACTORS_LOG_LEVEL", "warning"))


def info_enabled() -> bool:
    """Whether `configure_logging` let info events through: the runtime builds its per-call event only then (a
    filtered structlog call still costs a bound logger, ~2.5 us a call warm and several times that in a busy
    worker's task thread)."""
    return _INFO
