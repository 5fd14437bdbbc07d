"""Structured logging: one event per line, JSON to stderr (journald), or a
human-readable console renderer when stderr is a terminal.

Every event carries the context bound with ``bind_context`` (run id, node id,
role, policy version), through structlog's contextvars.
"""

from __future__ import annotations

import logging
import sys

import structlog


# The policy version this process holds, stamped on every event. A plain
# global, not a contextvar: asyncio tasks copy contextvars when created, so a
# version bound in one task would not reach events of the others.
_VERSION: dict[str, int] = {}


def set_version(version: int) -> None:
    _VERSION["version"] = version


def _add_version(logger, method, event: dict) -> dict:
    if "version" in _VERSION:
        event.setdefault("version", _VERSION["version"])
    return event


def setup_logging(level: str = "info", json: bool | None = None) -> None:
    if json is None:
        json = not sys.stderr.isatty()
    renderer = (
        structlog.processors.JSONRenderer()
        if json
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            _add_version,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            getattr(logging, level.upper(), logging.INFO)
        ),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    # vLLM and friends use stdlib logging; keep them on stderr, less chatty.
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING)


def bind_context(**kv) -> None:
    """Add keys (run, node, role, version, ...) to every later event."""
    structlog.contextvars.bind_contextvars(**kv)


def get_logger(name: str | None = None):
    return structlog.get_logger(name)


def log_throttled(emit, event: str, count: int, *, first: int = 10, every: int = 1000, **kv) -> None:
    """Log the ``count``-th occurrence of a repeated event only while it is
    news: the first ``first`` of them, then every ``every``-th. ``emit`` is
    the bound method (``log.warning``, ...); ``count`` goes on the event as
    ``total``, last. For events a peer can cause at will: a flood of garbage
    must not become a flood of log lines (the counters keep every one)."""
    if count <= first or count % every == 0:
        emit(event, **kv, total=count)
