"""The host KV tier on the bus: a worker serves reads of its tier's slots to other hosts' workers, and
copies another host's slots into its own tier when its scheduler asks (KvFetch), chunk by chunk."""

from __future__ import annotations

import asyncio

from nats.aio.client import Client
from nats.aio.msg import Msg

from services.worker.kv_tier import HostTier
from shared.bus.endpoints import ERROR_HEADER, Endpoints
from shared.log import get_logger
from shared.wire import subjects
from shared.wire.kv_events import KV_FETCH_DECODER, TIER_READ_DECODER, KvFetched, TierRead
from shared.wire.messages import encode

log = get_logger("worker.tier_peer")
CHUNK_OVERHEAD = 4096  # headers and the reply subject, under the server's max_payload
WINDOW = 8  # chunks in flight at once: the flow control of a fetch (each a request and its reply)
READ_TIMEOUT_S = 5.0


class TierPeer:
    def __init__(self, nc: Client, tier: HostTier, worker_id: str):
        self.nc = nc
        self.tier = tier
        self.worker_id = worker_id

    async def start(self, endpoints: Endpoints) -> None:
        """Every worker that maps the tier answers its reads (one queue group: any of them, once)."""
        await endpoints.add("kv_tier_read", subjects.kv_tier_read(self.tier.tier_id), self._on_read,
                            queue=f"kv-tier-{self.tier.tier_id}")
        await endpoints.add("kv_fetch", subjects.worker_kv_fetch(self.worker_id), self._on_fetch)

    async def _on_read(self, msg: Msg) -> None:
        read = TIER_READ_DECODER.decode(msg.data)
        await msg.respond(self.tier.read(read.slot, read.offset, read.length))

    async def _on_fetch(self, msg: Msg) -> None:
        """Copies the slots, WINDOW chunks in flight; any chunk that fails fails the fetch (the
        scheduler then drops our slots and the request computes its prompt instead)."""
        fetch = KV_FETCH_DECODER.decode(msg.data)
        error = None
        try:
            await self.fetch(fetch.tier_id, fetch.slots)
        except Exception as exc:  # noqa: BLE001 - a host gone, a timeout: told to the scheduler
            error = f"{type(exc).__name__}: {exc}"
            log.warning("kv_fetch_failed", tier_id=fetch.tier_id, error=error)
        await msg.respond(encode(KvFetched(error=error)))

    async def fetch(self, tier_id: str, slots: list[tuple[int, int]]) -> None:
        chunk = max(self.nc.max_payload - CHUNK_OVERHEAD, 1024)
        pieces = [(theirs, ours, offset, min(chunk, self.tier.slot_bytes - offset))
                  for theirs, ours in slots for offset in range(0, self.tier.slot_bytes, chunk)]
        subject, gate = subjects.kv_tier_read(tier_id), asyncio.Semaphore(WINDOW)

        async def one(theirs: int, ours: int, offset: int, length: int) -> None:
            async with gate:
                reply = await self.nc.request(subject, encode(TierRead(theirs, offset, length)), timeout=READ_TIMEOUT_S)
            if len(reply.data) != length:
                raise RuntimeError(f"tier {tier_id} answered {len(reply.data)} bytes for {length} "
                                   f"({(reply.headers or {}).get(ERROR_HEADER, 'no error given')})")
            self.tier.write(ours, offset, reply.data)

        await asyncio.gather(*(one(*piece) for piece in pieces))
