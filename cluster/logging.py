"""structlog set-up shared by every process: key=value lines (or JSON) on stderr; tracebacks
as plain text, never with local variables."""

from __future__ import annotations

import logging
import os
import sys

import structlog


def configure(process: str, level: str | None = None, json: bool | None = None) -> None:
    """Configure structlog and stdlib logging once per process; `process` is bound to every line."""
    level_name = (level or os.environ.get("KVCLUSTER_LOG_LEVEL", "INFO")).upper()
    use_json = json if json is not None else os.environ.get("KVCLUSTER_LOG_JSON") == "1"
    # Tracebacks as plain text: a rich traceback renders local variables (request bodies,
    # keys) and takes the event loop for about a second each.
    tail = ([structlog.processors.format_exc_info, structlog.processors.JSONRenderer()]
            if use_json else [structlog.dev.ConsoleRenderer(
                colors=False, exception_formatter=structlog.dev.plain_traceback)])
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            *tail,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping().get(level_name, logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(process=process)
    logging.basicConfig(level=level_name, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
