"""The KV-cache service on the bus: consume KV events, answer lookups and stats, resync on start."""

from __future__ import annotations

from nats.aio.client import Client
from nats.aio.msg import Msg

from services.kvcache.index import KvIndex
from shared import subjects
from shared.log import get_logger
from shared.messages import (
    KV_EVENT_BATCH_DECODER,
    KV_LOOKUP_DECODER,
    KvLookupReply,
    KvStatsReply,
    Resync,
    encode,
)

log = get_logger("kvcache")


class KvCacheService:
    def __init__(self, nc: Client):
        self.nc = nc
        self.index = KvIndex()
        self._subs = []

    async def start(self) -> None:
        self._subs += [
            await self.nc.subscribe(subjects.KV_EVENTS_ALL, cb=self._on_events),
            await self.nc.subscribe(subjects.KV_LOOKUP, queue="kvcache", cb=self._on_lookup),
            await self.nc.subscribe(subjects.KV_STATS, queue="kvcache", cb=self._on_stats),
        ]
        # after our own restart, the schedulers republish everything they hold
        await self.nc.publish(subjects.KV_RESYNC, encode(Resync()))
        log.info("kvcache_ready")

    async def drain(self, grace_s: float) -> None:
        """Nothing in flight to finish: the index is rebuilt from the schedulers on restart."""

    async def stop(self) -> None:
        for sub in self._subs:
            await sub.unsubscribe()

    async def _on_events(self, msg: Msg) -> None:
        self.index.apply(KV_EVENT_BATCH_DECODER.decode(msg.data))

    async def _on_lookup(self, msg: Msg) -> None:
        lookup = KV_LOOKUP_DECODER.decode(msg.data)
        await msg.respond(encode(KvLookupReply(self.index.longest_prefix(lookup.model, lookup.block_hashes))))

    async def _on_stats(self, msg: Msg) -> None:
        await msg.respond(encode(KvStatsReply(num_blocks_by_pool=self.index.num_blocks_by_pool(),
                                              model_by_pool=dict(self.index.model_by_pool))))
