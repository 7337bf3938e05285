"""A service's bus handlers served as nats.py's micro serves its endpoints: each one counted and
timed, one that raises answers its request with micro's error headers, and `$SRV.STATS` reports them."""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg

from shared.log import get_logger
from shared.wire import subjects

log = get_logger("endpoints")
ERROR_HEADER = "Nats-Service-Error"  # micro's: the error's description
ERROR_CODE_HEADER = "Nats-Service-Error-Code"  # micro's: its code (400: the message did not decode; 500: else)
STATS_TYPE = "io.nats.micro.v1.stats_response"
Handler = Callable[[Msg], Awaitable[None]]


@dataclass
class EndpointStats:
    """micro's EndpointStats: times in nanoseconds."""

    name: str
    subject: str
    queue_group: str
    num_requests: int = 0
    num_errors: int = 0
    last_error: str = ""
    processing_time: int = 0

    @property
    def average_processing_time(self) -> int:
        return self.processing_time // self.num_requests if self.num_requests else 0

    def as_json(self) -> dict:
        return {"name": self.name, "subject": self.subject, "queue_group": self.queue_group,
                "num_requests": self.num_requests, "num_errors": self.num_errors, "last_error": self.last_error,
                "processing_time": self.processing_time,
                "average_processing_time": self.average_processing_time}


class Endpoints:
    """Unlike micro's endpoints, which always join a queue group, a broadcast handler (every
    scheduler hears each hello) subscribes without one; both kinds are counted alike."""

    def __init__(self, nc: Client, service: str, instance_id: str, version: str = "1"):
        self.nc = nc
        self.service = service
        self.instance_id = instance_id
        self.version = version
        self.started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self.stats: dict[str, EndpointStats] = {}
        self._subs = []

    async def start(self) -> None:
        """Answer micro's stats requests, for the service and for this instance."""
        for subject in (subjects.service_stats(self.service, ""), subjects.service_stats(self.service, self.instance_id)):
            self._subs.append(await self.nc.subscribe(subject, cb=self._on_stats))

    async def add(self, name: str, subject: str, handler: Handler, queue: str = "") -> None:
        stats = self.stats[name] = EndpointStats(name, subject, queue)

        async def serve(msg: Msg) -> None:
            started = time.perf_counter_ns()
            stats.num_requests += 1
            try:
                await handler(msg)
            except Exception as exc:  # noqa: BLE001 - counted, logged and answered; the service goes on
                stats.num_errors += 1
                stats.last_error = f"{type(exc).__name__}: {exc}"[:500]
                log.error("handler_failed", service=self.service, endpoint=name, error=stats.last_error)
                if msg.reply:
                    await self.nc.publish(msg.reply, b"", headers={
                        ERROR_HEADER: stats.last_error.replace("\r", " ").replace("\n", " "),
                        ERROR_CODE_HEADER: "400" if isinstance(exc, msgspec.DecodeError) else "500"})
            finally:
                stats.processing_time += time.perf_counter_ns() - started

        self._subs.append(await self.nc.subscribe(subject, queue=queue, cb=serve))

    async def stop(self) -> None:
        for sub in self._subs:
            await sub.unsubscribe()
        self._subs.clear()

    def stats_response(self) -> dict:
        return {"type": STATS_TYPE, "name": self.service, "id": self.instance_id, "version": self.version,
                "started": self.started, "endpoints": [s.as_json() for s in self.stats.values()]}

    async def _on_stats(self, msg: Msg) -> None:
        if msg.reply:
            await msg.respond(json.dumps(self.stats_response()).encode())


def error_of(msg: Msg) -> str | None:
    """A reply's error, as micro's headers carry it (None: not an error)."""
    headers = msg.headers or {}
    return f"{headers[ERROR_CODE_HEADER]} {headers.get(ERROR_HEADER, '')}" if ERROR_CODE_HEADER in headers else None
