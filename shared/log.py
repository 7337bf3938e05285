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
            _Service(service),  # on every thread's records (a context variable is not seen by new threads)
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.processors.format_exc_info,  # log.exception(...): the traceback, in the JSON line
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=LineLoggerFactory(sys.stderr.fileno()),
        cache_logger_on_first_use=True,
    )
    _configured = True


class _Service:
    def __init__(self, service: str):
        self.service = service

    def __call__(self, _logger, _name, event: dict) -> dict:
        event.setdefault("service", self.service)
        return event


class LineLogger:
    """Each record one write(2) of its whole line: print() writes the text and its newline apart, so
    two threads (a worker's bus and model threads) or two processes on one stdout could merge lines.
    A pipe takes a write of up to PIPE_BUF (4 KiB) whole, whoever else writes to it."""

    def __init__(self, fd: int):
        self.fd = fd

    def msg(self, message: str) -> None:
        data = (message + "\n").encode("utf-8", "replace")
        while data:
            try:
                data = data[os.write(self.fd, data):]
            except InterruptedError:
                continue
            except OSError:  # the reader is gone: a log line is not worth dying for
                return

    log = debug = info = warn = warning = error = critical = exception = failure = fatal = msg


class LineLoggerFactory:
    def __init__(self, fd: int):
        self.fd = fd

    def __call__(self, *args) -> LineLogger:
        return LineLogger(self.fd)


def get_logger(name: str):
    return structlog.get_logger(name)
