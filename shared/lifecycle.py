"""How every service process runs: start, wait for SIGINT/SIGTERM, stop, let go of the bus."""

from __future__ import annotations

import asyncio
import signal
from typing import Protocol

from nats.aio.client import Client

from shared.bus import close


class Service(Protocol):
    async def start(self) -> None: ...
    async def stop(self) -> None: ...


async def serve_until_signalled(nc: Client, service: Service) -> None:
    await service.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await service.stop()
    await close(nc)
