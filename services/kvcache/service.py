"""The KV-cache service on the bus: consume KV events, answer lookups and stats, resync on start."""

from __future__ import annotations

import uuid

from nats.aio.client import Client
from nats.aio.msg import Msg

from services.kvcache.index import KvIndex
from shared.bus.endpoints import Endpoints
from shared.log import get_logger
from shared.wire import subjects
from shared.wire.kv_events import (
    KV_EVENT_BATCH_DECODER,
    KV_LOOKUP_DECODER,
    KvLookupReply,
    KvStatsReply,
    Resync,
)
from shared.wire.messages import (
    encode,
)

log = get_logger("kvcache")


class KvCacheService:
    def __init__(self, nc: Client):
        self.nc = nc
        self.index = KvIndex()
        self.endpoints = Endpoints(nc, "kvcache", uuid.uuid4().hex[:12])

    async def start(self) -> None:
        await self.endpoints.add("events", subjects.KV_EVENTS_ALL, self._on_events)
        await self.endpoints.add("lookup", subjects.KV_LOOKUP, self._on_lookup, queue="kvcache")
        await self.endpoints.add("stats", subjects.KV_STATS, self._on_stats, queue="kvcache")
        await self.endpoints.start()
        # after our own restart, the schedulers republish everything they hold
        await self.nc.publish(subjects.KV_RESYNC, encode(Resync()))
        log.info("kvcache_ready")

    async def drain(self, grace_s: float) -> None:
        """Nothing in flight to finish: the index is rebuilt from the schedulers on restart."""

    async def stop(self) -> None:
        await self.endpoints.stop()

    async def _on_events(self, msg: Msg) -> None:
        self.index.apply(KV_EVENT_BATCH_DECODER.decode(msg.data))

    async def _on_lookup(self, msg: Msg) -> None:
        lookup = KV_LOOKUP_DECODER.decode(msg.data)
        await msg.respond(encode(KvLookupReply(self.index.longest_prefix(lookup.model, lookup.block_hashes))))

    async def _on_stats(self, msg: Msg) -> None:
        await msg.respond(encode(KvStatsReply(num_blocks_by_pool=self.index.num_blocks_by_pool(),
                                              model_by_pool=dict(self.index.model_by_pool))))
