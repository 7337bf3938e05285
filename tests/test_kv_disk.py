"""The host KV tier's disk spill (--kv-offloading-disk-size): blocks the tier's LRU drops go to a
file on a local disk and are loaded straight into the pool on a prefix hit; the real model's
conversations through a tier of three slots give lone runs' tokens."""

from __future__ import annotations

import pytest
import torch

from services.scheduler.host_tier import DISK, TierIndex
from services.scheduler.kv_cache_manager import KVCacheManager
from services.scheduler.scheduler import Scheduler
from services.worker.kv_disk import DiskTier
from services.worker.kv_tier import HostTier
from shared.checks import ConfigError
from shared.config import EngineConfig
from shared.wire.hashing import root_hash
from shared.wire.kv_events import BlockRemoved, BlockStored, HostTierInfo
from tests.inproc_engine import InProcessEngine
from tests.test_host_tier import talk
from tests.test_scheduler import req, run_step


def _spilling(disk_slots: int = 8) -> Scheduler:
    tier = TierIndex(HostTierInfo(tier_id="t", num_slots=2, disk_slots=disk_slots))
    return Scheduler(KVCacheManager(6, 4, root_hash("m", "auto"), tier=tier), 4, 64)


def _step(s: Scheduler, ok: bool = True):
    plan, finished = run_step(s)
    s.kv.end_transfers(ok)
    return plan


def _fill_and_spill(s: Scheduler, ok: bool = True):
    """a's two blocks written through to the tier's two slots; then big's evict a's from the pool
    and take the tier's slots: a's go to the disk in the same Step, before the saves reuse them."""
    s.add_request(req("a", 9, max_tokens=1))
    _step(s)
    _step(s)  # a's blocks written through
    s.add_request(req("big", 21, max_tokens=1, first=100))  # the whole pool: a's blocks evicted
    _step(s)
    return _step(s, ok)  # big's first two blocks saved; a's spilled out of their slots


def test_what_the_tier_drops_goes_to_the_disk_and_loads_straight_into_the_pool():
    s = _spilling()
    tier, disk = s.kv.tier, s.kv.tier.disk
    plan = _fill_and_spill(s)
    assert len(plan.step.kv_spills) == 2 and len(plan.step.kv_saves) == 2
    assert {slot for slot, _ in plan.step.kv_spills} == {slot for _, slot in plan.step.kv_saves}  # spilled, reused
    assert len(disk.entries) == 2 and not disk.pending
    assert disk.take_events() == [BlockStored(block_hashes=list(disk.entries), medium=DISK)]
    a_on_disk = sorted(disk.entries.values())
    s.add_request(req("b", 9, max_tokens=1))  # a's prompt: the pool and the tier lost it, the disk has it
    plan = _step(s)
    new = plan.step.new_seqs[0]
    assert new.num_computed_tokens == 8 and not plan.step.kv_loads
    assert sorted(d for d, _ in plan.step.kv_disk_loads) == a_on_disk
    assert [block for _, block in plan.step.kv_disk_loads] == new.block_ids[:2]
    assert s.kv.num_tier_hit_tokens == 8 and tier.num_loaded == 2  # vLLM's external prefix cache hits
    assert not disk.pins and not tier.pins and not tier.pending  # nothing leaked


def test_a_failed_spill_leaves_the_disk_as_it_was():
    s = _spilling()
    _fill_and_spill(s, ok=False)
    disk = s.kv.tier.disk
    assert not disk.entries and not disk.pending and len(disk.free_slots) == 8
    s.add_request(req("b", 9, max_tokens=1))
    plan = _step(s)
    assert plan.step.new_seqs[0].num_computed_tokens == 0 and not plan.step.kv_disk_loads


def test_the_disk_is_lru_too_and_never_drops_a_slot_a_load_reads():
    tier = TierIndex(HostTierInfo(tier_id="t", num_slots=1, disk_slots=1))
    disk = tier.disk
    assert disk.reserve(b"x") == 0 and disk.reserve(b"y") is None  # its one slot pending
    disk.commit([b"x"])
    disk.pin(0)  # a disk load in flight reads x
    assert disk.reserve(b"y") is None
    disk.unpin(0)
    assert disk.reserve(b"y") == 0 and disk.lookup(b"x") is None
    assert BlockRemoved(block_hashes=[b"x"], medium=DISK) in disk.take_events()


def test_without_a_tier_the_disk_is_refused():
    with pytest.raises(ConfigError, match="--kv-offloading-size"):
        EngineConfig(kv_offloading_disk_size=1.0).validate()


# ---- the worker's file -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_worker_spills_slots_and_loads_them_back_bit_for_bit(tmp_path, dtype):
    tensors = [torch.randn(5, 2, 4, 8).to(dtype) for _ in range(3)]
    (tmp_path / "shm").mkdir()
    tier = HostTier.open("m", tensors, 0.001, directory=tmp_path / "shm")
    tier.disk = DiskTier.open(tier, 0.001, tmp_path)
    try:
        before = [t.clone() for t in tensors]
        tier.transfer(tensors, saves=[(1, 0), (3, 1)], loads=[])
        # slot 0 spilled to disk slot 5 before block 2's save takes it
        tier.transfer(tensors, saves=[(2, 0)], loads=[], spills=[(0, 5), (1, 6)])
        for t in tensors:
            t.zero_()
        tier.transfer(tensors, saves=[], loads=[(0, 0)], disk_loads=[(5, 4), (6, 1)])
        for t, old in zip(tensors, before, strict=True):
            assert torch.equal(t[4], old[1]) and torch.equal(t[1], old[3]) and torch.equal(t[0], old[2])
        assert tier.info().disk_slots == tier.disk.num_slots > 6
    finally:
        tier.close()
    assert not list(tmp_path.glob("switchyard-kv-*")) and not list((tmp_path / "shm").glob("switchyard-kv-*"))


# ---- the real model ----------------------------------------------------------------------------------


def test_conversations_through_a_three_slot_tier_come_back_from_the_disk(loaded_model, tmp_path):
    """Histories of several blocks each over an 8-block pool and a tier of 3 slots: later turns load
    their prefixes from the disk. Greedy tokens equal each prompt run alone."""
    torch.manual_seed(1)
    vocab = loaded_model.config.vocab_size
    histories = [torch.randint(10, vocab, (40,)).tolist() for _ in range(3)]
    shape = InProcessEngine(loaded_model, num_blocks=8).runner.backend.kv_tensors()
    slot_gib = sum(t[0].numel() * t.element_size() for t in shape) / 2**30
    (tmp_path / "shm").mkdir()
    tier = HostTier.open("test-model", shape, 3.5 * slot_gib, directory=tmp_path / "shm")
    tier.disk = DiskTier.open(tier, 64 * slot_gib, tmp_path)
    try:
        assert tier.num_slots == 3
        engine = InProcessEngine(loaded_model, num_blocks=8, max_num_batched_tokens=64, tier=tier)
        assert engine.outputs == talk(loaded_model, engine, histories)
        index = engine.scheduler.kv.tier
        assert index.disk.entries and index.disk.num_loaded > 0  # loaded from the disk, not only the tier
        later = [engine.num_cached_tokens[f"c{i}-t2"] for i in range(3)]
        assert all(n >= 32 for n in later), later  # each last turn started from its history's blocks
        assert not index.disk.pins and not index.disk.pending and not index.pins and not index.pending
    finally:
        tier.close()


# ---- a stack: the flags, the worker's files, the KV index ---------------------------------------------


@pytest.mark.stack
def test_a_stack_with_a_disk_spill_answers_as_lone_runs(tmp_path_factory, model_name):
    """`--kv-offloading-disk-size` through the launcher: a tier of 40 slots (more than a Step writes)
    and a disk behind it;
    conversations overflowing both the pool and the tier come back with salted lone runs' tokens,
    their prefixes loaded from the disk; the KV index lists the disk as a pool of its own."""
    import asyncio

    import httpx
    import nats

    from shared.bus.client import BusClient
    from tests.conftest import _start_stack
    from tests.test_host_tier_stack import _run
    from tests.test_two_workers import _wait_for_workers, kv_stats

    disk_dir = tmp_path_factory.mktemp("disk")
    s = _start_stack(tmp_path_factory, "disk-spill", num_workers=1, extra_args=[
        "--num-kv-blocks", "24", "--max-model-len", "384", "--kv-offloading-size", "0.028",
        "--kv-offloading-disk-size", "0.05", "--kv-offloading-disk-dir", str(disk_dir)])

    async def conversations() -> None:
        await _wait_for_workers(s.admin_url, model_name, 1)
        nc = await nats.connect(s.admin_url)
        bus = BusClient(nc)
        await bus.start()
        try:
            prompts = [[3000 + 200 * c + i for i in range(120)] for c in range(4)]
            for turn in range(2):
                for c, prompt in enumerate(prompts):
                    _, cached, tokens = await _run(bus, model_name, prompt, 8)
                    _, _, alone = await _run(bus, model_name, prompt, 8, salt=f"alone-{c}-{turn}")
                    assert tokens == alone
                    if turn:
                        assert cached >= 96, cached  # its history came back from the tier or the disk
                    prompt += tokens
            pools = await kv_stats(nc)
            assert any(p.startswith("disk:") and n > 0 for p, n in pools.items()), pools
        finally:
            await bus.stop()
            await nc.close()

    try:
        assert list(disk_dir.glob("switchyard-kv-*.disk"))
        asyncio.run(conversations())
        metrics = httpx.get(s.base_url + "/metrics", timeout=10).text
        assert float(next(line for line in metrics.splitlines()
                          if line.startswith("vllm:external_prefix_cache_hits_total")).split()[-1]) >= 4 * 96
    finally:
        s.stop()
    assert not list(disk_dir.glob("switchyard-kv-*"))  # the worker out: the spill removed
