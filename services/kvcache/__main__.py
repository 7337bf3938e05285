"""python -m services.kvcache: the cluster index of cached KV blocks, for prefix-aware routing."""

from __future__ import annotations

import argparse
import asyncio
import signal

from services.kvcache.service import KvCacheService
from shared import log as sylog
from shared import bus
from shared.bus import connect
from shared.config import add_nats_arg


async def main() -> None:
    parser = argparse.ArgumentParser(description="Switchyard KV-cache index")
    add_nats_arg(parser)
    args = parser.parse_args()
    sylog.configure("kvcache")
    nc = await connect(args.nats_url, "kvcache")
    service = KvCacheService(nc)
    await service.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await service.stop()
    await bus.close(nc)


if __name__ == "__main__":
    asyncio.run(main())
