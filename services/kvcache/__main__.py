"""python -m services.kvcache: the cluster index of cached KV blocks, for prefix-aware routing."""

from __future__ import annotations

import argparse
import asyncio

from services.kvcache.service import KvCacheService
from shared import log as sylog
from shared.bus import connect
from shared.bus.lifecycle import serve_until_signalled
from shared.config import add_nats_arg


async def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description="Switchyard KV-cache index")
    add_nats_arg(parser)
    args = parser.parse_args()
    sylog.configure("kvcache")
    nc = await connect(args.nats_url, "kvcache")
    service = KvCacheService(nc)
    await serve_until_signalled(nc, service)


if __name__ == "__main__":
    asyncio.run(main())
