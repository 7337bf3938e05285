"""What a pool tells the KV index (sy.v1.kv.events.<pool>): its blocks, and its host tier's and the
tier's disk spill's as pools of their own (shared by the workers that map them)."""

from __future__ import annotations

from nats.aio.client import Client

from services.scheduler.host_tier import DISK, MEDIUM, TierIndex
from services.scheduler.kv_manager import KVManager
from shared.wire import subjects
from shared.wire.kv_events import BlockStored, KvEvent, KvEventBatch, PoolCleared
from shared.wire.messages import encode


async def _publish(nc: Client, model: str, pool_id: str, events: list[KvEvent]) -> None:
    if events:
        await nc.publish(subjects.kv_events(pool_id), encode(KvEventBatch(pool=pool_id, model=model, events=events)))


async def publish_events(nc: Client, model: str, worker_id: str, kv: KVManager, tier: TierIndex | None) -> None:
    """The blocks stored and removed since the last call."""
    await _publish(nc, model, worker_id, kv.take_events())
    if tier is not None:
        await _publish(nc, model, tier.pool_id, tier.take_events())
        if tier.disk is not None:
            await _publish(nc, model, tier.disk_pool_id, tier.disk.take_events())


async def publish_cleared(nc: Client, model: str, worker_id: str) -> None:
    """The worker's pool holds nothing now (parked for sleep, or gone)."""
    await _publish(nc, model, worker_id, [PoolCleared()])


async def publish_snapshot(nc: Client, model: str, worker_id: str, kv: KVManager, tier: TierIndex | None) -> None:
    """PoolCleared then everything held: how the KV index (re)learns each of them."""
    def snapshot(hashes: list[bytes], medium: str | None) -> list[KvEvent]:
        return [PoolCleared()] + ([BlockStored(block_hashes=hashes, medium=medium)] if hashes else [])

    await _publish(nc, model, worker_id, snapshot(kv.cached_hashes(), None))
    if tier is not None:
        await _publish(nc, model, tier.pool_id, snapshot(list(tier.entries), MEDIUM))
        if tier.disk is not None:
            await _publish(nc, model, tier.disk_pool_id, snapshot(list(tier.disk.entries), DISK))
