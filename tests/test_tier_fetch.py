"""Prefixes on another host: a worker copies slots of another host's KV tier into its own over a
real nats-server, in chunks under max_payload, and a host that does not answer fails the fetch
within seconds, leaving the tiers as they were."""

from __future__ import annotations

from types import SimpleNamespace

import nats
import pytest
import torch

from services.scheduler import tier_fetch
from services.scheduler.host_tier import HostTiers
from services.scheduler.kv_cache_manager import KVCacheManager
from services.scheduler.request import Request
from services.worker import tier_peer
from services.worker.kv_tier import HostTier
from services.worker.tier_peer import TierPeer
from shared.bus.endpoints import Endpoints
from shared.wire.hashing import root_hash
from shared.wire.messages import SamplingParams
from switchyard.nats_server import NatsServer

pytestmark = pytest.mark.stack
BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def bus():
    server = NatsServer().start()
    yield server
    server.stop()


async def _host(bus, tmp_path, name: str, tensors):
    """A host: its tier's file and a worker serving it on the bus."""
    tier = HostTier.open("m", tensors, 0.001, directory=tmp_path / name)
    nc = await nats.connect(bus.url)
    endpoints = Endpoints(nc, "worker", f"worker-{name}")
    await TierPeer(nc, tier, f"worker-{name}").start(endpoints)
    await endpoints.start()
    return tier, nc


async def test_a_prefix_on_another_host_is_copied_into_this_hosts_tier(bus, tmp_path, monkeypatch):
    monkeypatch.setattr(tier_peer, "CHUNK_OVERHEAD", 1024 * 1024 - 1500)  # 1,500-byte chunks: 17 a slot
    for host in ("a", "b"):
        (tmp_path / host).mkdir()
    tensors = [torch.randn(6, 4, 16, 32) for _ in range(3)]
    (tier_a, nc_a), (tier_b, nc_b) = [await _host(bus, tmp_path, h, tensors) for h in ("a", "b")]
    scheduler_nc = await nats.connect(bus.url)
    try:
        tiers = HostTiers()
        index_a, index_b = tiers.get(tier_a.info()), tiers.get(tier_b.info())
        kv = KVCacheManager(8, BLOCK_SIZE, root_hash("m", "auto"), tier=index_b)
        pool = SimpleNamespace(tier=index_b, scheduler=SimpleNamespace(kv=kv), worker_id="worker-b")
        request = Request("r", list(range(13)), SamplingParams(max_tokens=1), reply_to="")
        kv.update_block_hashes(request)
        slots_a = [index_a.reserve(h) for h in request.block_hashes]  # host A computed the 3 blocks
        tier_a.transfer(tensors, saves=[(block, slot) for block, slot in enumerate(slots_a)], loads=[])
        index_a.commit(request.block_hashes)

        assert await tier_fetch.fetch_remote_prefix(scheduler_nc, pool, request) == 3
        assert index_b.num_leading(request.block_hashes) == 3 and not index_a.pins
        for block_hash, slot_a in zip(request.block_hashes, slots_a, strict=True):
            assert tier_b.read(index_b.lookup(block_hash), 0, tier_b.slot_bytes) == \
                tier_a.read(slot_a, 0, tier_a.slot_bytes)
        assert await tier_fetch.fetch_remote_prefix(scheduler_nc, pool, request) == 0  # held here now

        # host A gone (its worker no longer answers): the fetch fails and leaves nothing pending
        other = Request("s", list(range(100, 109)), SamplingParams(max_tokens=1), reply_to="")
        kv.update_block_hashes(other)
        index_a.commit([h for h in other.block_hashes if index_a.reserve(h) is not None])
        await nc_a.close()
        monkeypatch.setattr(tier_peer, "READ_TIMEOUT_S", 1.0)
        assert await tier_fetch.fetch_remote_prefix(scheduler_nc, pool, other) == 0
        assert index_b.num_leading(other.block_hashes) == 0 and not index_b.pending and not index_a.pins
    finally:
        for nc in (nc_a, nc_b, scheduler_nc):
            if not nc.is_closed:
                await nc.close()
        tier_a.close()
        tier_b.close()
