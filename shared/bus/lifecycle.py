"""How every service process runs: start, wait for SIGINT/SIGTERM, drain, stop, let go of the bus.

The first signal drains (in-flight work may finish within the grace period); a second one stops
at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from typing import Protocol

from nats.aio.client import Client

from shared.bus.connection import close


class Service(Protocol):
    async def start(self) -> None: ...
    async def drain(self, grace_s: float) -> None: ...
    async def stop(self) -> None: ...


async def serve_until_signalled(nc: Client, service: Service, drain_grace_s: float = 0.0) -> None:
    signalled = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, signalled.set)
    await serve(nc, service, signalled, drain_grace_s)


async def serve(nc: Client, service: Service, signalled: asyncio.Event, drain_grace_s: float = 0.0) -> None:
    """Start, wait for `signalled`, drain (until done or signalled again), stop, close the bus."""
    await service.start()
    await signalled.wait()
    signalled.clear()
    drain = asyncio.create_task(service.drain(drain_grace_s))
    again = asyncio.create_task(signalled.wait())
    await asyncio.wait({drain, again}, return_when=asyncio.FIRST_COMPLETED)
    for task in (drain, again):
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    await service.stop()
    await close(nc)
