"""structlog JSON lines, one configuration for every service."""

from __future__ import annotations

import logging
import os
import sys

import structlog

_configured = False


def configure(service: str) -> None:
    global _configured
    level = getattr(logging, os.environ.get("SY_LOG_LEVEL", "INFO").upper(), logging.INFO)
    logging.basicConfig(stream=sys.stderr, level=level, format="%(message)s")
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.processors.format_exc_info,  # log.exception(...): the traceback, in the JSON line
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(service=service)
    _configured = True


def get_logger(name: str):
    return structlog.get_logger(name)
