"""The host KV tier (--kv-offloading-size): the scheduler's index, the worker's shared memory, and
prefixes loaded back from it giving a lone run's tokens with the real model."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from services.scheduler.host_tier import MEDIUM, TierIndex
from services.scheduler.kv_cache_manager import KVCacheManager
from services.scheduler.request import Request
from services.scheduler.scheduler import Scheduler
from services.worker.kv_tier import HostTier, sweep, tier_name
from shared.wire.hashing import root_hash
from shared.wire.kv_events import BlockRemoved, BlockStored, HostTierInfo
from tests.inproc_engine import InProcessEngine
from tests.test_scheduler import req, run_step

# ---- the scheduler's index ---------------------------------------------------------------------------


def test_index_is_lru_over_committed_slots_and_never_reuses_a_pinned_or_pending_one():
    tier = TierIndex(HostTierInfo(tier_id="t", num_slots=2))
    a, b, c = tier.reserve(b"a"), tier.reserve(b"b"), tier.reserve(b"c")
    assert {a, b} == {0, 1} and c is None  # both slots pending: nothing to evict
    assert tier.lookup(b"a") is None  # pending: its Step is not back
    tier.commit([b"a", b"b"])
    assert tier.lookup(b"a") == a and tier.num_leading([b"a", b"b", b"x"]) == 2
    assert tier.reserve(b"a") is None  # held already: now the most recently used
    tier.pin(b)  # a load in flight reads b's slot...
    assert tier.reserve(b"c") == a  # ...so the least recently used unpinned entry goes: a
    tier.unpin(b)
    tier.abort([b"c"])  # its Step failed: the slot is free again, c never readable
    assert tier.lookup(b"c") is None and tier.free_slots == [a]
    events = tier.take_events()
    assert events == [BlockStored(block_hashes=[b"a", b"b"], medium=MEDIUM),
                      BlockRemoved(block_hashes=[b"a"], medium=MEDIUM)]


async def test_held_blocks_outlive_the_lru_until_released_or_expired():
    """kv_transfer_params: a prefill's blocks wait for the decode request, out of the LRU's reach;
    the gateway's question, asked before the hold exists, is answered once its Step is back."""
    import asyncio

    from services.scheduler.kv_holds import HOLD_S, KvHolds

    tier = TierIndex(HostTierInfo(tier_id="t", num_slots=2))
    for block_hash in (b"a", b"b"):
        tier.reserve(block_hash)
    tier.commit([b"a", b"b"])
    holds = KvHolds()
    answer = asyncio.ensure_future(holds.answer("prefill-1", timeout_s=5))
    await asyncio.sleep(0)  # one turn of the loop (not a wait for time): the question is asked first
    assert "prefill-1" in holds._waiters
    hold = holds.hold("prefill-1", tier, [b"a", b"b"], now=0.0)
    await asyncio.sleep(0)
    assert not answer.done()  # the Step saving its last blocks is not back
    hold.settled.set()
    assert (await answer).slots == [tier.lookup(b"a"), tier.lookup(b"b")] and (await answer).tier_id == "t"
    assert tier.reserve(b"c") is None  # both slots held: nothing may be evicted
    holds.release("prefill-1")
    assert tier.reserve(b"c") is not None and tier.lookup(b"a") is None  # the LRU takes a again
    tier.abort([b"c"])
    holds.hold("prefill-2", tier, [b"b"], now=0.0)
    holds.expire(HOLD_S - 1)
    assert len(holds) == 1
    holds.expire(HOLD_S)
    assert len(holds) == 0 and not tier.held
    missing = await holds.answer("never", timeout_s=0.05)
    assert missing.error is not None and not missing.slots


def _tiered(num_blocks=6, num_slots=8, budget=64) -> Scheduler:
    tier = TierIndex(HostTierInfo(tier_id="t", num_slots=num_slots))
    return Scheduler(KVCacheManager(num_blocks, 4, root_hash("m", "auto"), tier=tier), 4, budget)


def _step(s: Scheduler, ok: bool = True):
    plan, finished = run_step(s)
    s.kv.end_transfers(ok)
    return plan, finished


def test_evicted_blocks_are_saved_then_loaded_back_instead_of_recomputed():
    s = _tiered()
    s.add_request(req("a", 9, max_tokens=1))
    _step(s)  # a's two full blocks cached in the pool, then free
    s.add_request(req("big", 21, max_tokens=1, first=100))  # 6 blocks: takes a's two
    plan, _ = _step(s)
    saved = dict(plan.step.kv_saves)  # block -> slot
    assert len(saved) == 2 and s.kv.tier.num_leading(_hashes(s, req("a", 9))) == 2
    s.add_request(req("b", 9, max_tokens=1))  # a's prompt again: both blocks from the tier
    plan, _ = _step(s)
    new = plan.step.new_seqs[0]
    assert new.num_computed_tokens == 8 and plan.num_new_tokens == {"b": 1}
    assert sorted(slot for slot, _ in plan.step.kv_loads) == sorted(saved.values())
    assert [block for _, block in plan.step.kv_loads] == new.block_ids[:2]
    assert s.kv.num_tier_hit_tokens == 8 and s.kv.num_hit_tokens == 0  # vLLM's external prefix cache hits
    assert s.kv.pool.num_free == 6 and not s.kv.tier.pins and not s.kv.tier.pending  # nothing leaked


def _hashes(s: Scheduler, request: Request) -> list[bytes]:
    s.kv.update_block_hashes(request)
    return request.block_hashes


def test_a_failed_step_drops_its_saves_and_distrusts_its_loads():
    s = _tiered()
    s.add_request(req("a", 9, max_tokens=1))
    _step(s)
    s.add_request(req("big", 21, max_tokens=1, first=100))
    _step(s, ok=False)  # the saves' Step failed: the tier never holds a's blocks
    assert not s.kv.tier.entries and len(s.kv.tier.free_slots) == 8
    s.add_request(req("b", 9, max_tokens=1))
    plan, _ = _step(s)
    assert plan.step.new_seqs[0].num_computed_tokens == 0 and not plan.step.kv_loads


def test_a_load_that_failed_leaves_no_cached_hash_behind():
    s = _tiered()
    s.add_request(req("a", 9, max_tokens=1))
    _step(s)
    s.add_request(req("big", 21, max_tokens=1, first=100))
    _step(s)
    s.add_request(req("b", 9, max_tokens=1))
    plan, _ = run_step(s)
    assert plan.step.kv_loads
    s.kv.end_transfers(ok=False)  # the worker may not have copied them
    assert not any(s.kv.pool.blocks[block].block_hash for _, block in plan.step.kv_loads)
    assert not s.kv.tier.pins


def test_without_a_tier_nothing_moves():
    s = Scheduler(KVCacheManager(6, 4, root_hash("m", "auto")), 4, 64)
    s.add_request(req("a", 9, max_tokens=1))
    run_step(s)
    s.add_request(req("big", 21, max_tokens=1, first=100))
    plan, _ = run_step(s)
    assert plan.step.kv_saves == [] and plan.step.kv_loads == []


# ---- the worker's shared memory ----------------------------------------------------------------------


def _pool(dtype, num_blocks=5, device="cpu"):
    return [torch.randn(num_blocks, 2, 4, 8).to(dtype).to(device) for _ in range(3)]


# on a GPU: the tier in shared memory, pinned (asynchronous copies); in a file on disk, which CUDA
# may refuse to pin (the copies then pageable and synchronous)
PLACES = ["cpu", *(["cuda-shm", "cuda-disk"] * torch.cuda.is_available())]


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_worker_copies_blocks_out_and_back_bit_for_bit(tmp_path, dtype, place):
    device, _, where = place.partition("-")
    tensors = _pool(dtype, device=device)
    directory = Path(tempfile.mkdtemp(dir="/dev/shm")) if where == "shm" else tmp_path
    tier = HostTier.open("m", tensors, 0.001, directory=directory)
    try:
        if device == "cpu" or where == "shm":
            assert (tier.copies is not None) == (where == "shm")
        before = [t.clone() for t in tensors]
        tier.transfer(tensors, saves=[(1, 0), (3, 3), (2, 2)], loads=[])  # slots 2 and 3: one copy
        tier.settle()
        for t in tensors:
            t.zero_()
        tier.transfer(tensors, saves=[], loads=[(0, 4), (3, 0), (2, 1)])  # into other blocks
        tier.settle()
        for t, old in zip(tensors, before, strict=True):
            assert torch.equal(t[4].view(torch.uint8), old[1].view(torch.uint8))
            assert torch.equal(t[0].view(torch.uint8), old[3].view(torch.uint8))
            assert torch.equal(t[1].view(torch.uint8), old[2].view(torch.uint8))
            assert not t[2].any() and not t[3].any()
        with pytest.raises(ValueError, match="out of range"):
            tier.transfer(tensors, saves=[(5, 0)], loads=[])
    finally:
        tier.close()
        if where == "shm":
            shutil.rmtree(directory)


def test_workers_of_a_model_share_one_file_and_the_last_removes_it(tmp_path):
    tensors = _pool(torch.float32)
    first = HostTier.open("m", tensors, 0.001, directory=tmp_path)
    second = HostTier.open("m", tensors, 0.002, directory=tmp_path)  # asks for more: the tier keeps its size
    other = HostTier.open("other-model", tensors, 0.001, directory=tmp_path)
    assert second.tier_id == first.tier_id and second.num_slots == first.num_slots
    assert other.tier_id != first.tier_id
    tensors[0][2] = 7.0
    first.transfer(tensors, saves=[(2, 1)], loads=[])
    tensors[0][2] = 0.0
    second.transfer(tensors, saves=[], loads=[(1, 2)])  # what one worker saved, another loads
    assert (tensors[0][2] == 7.0).all()
    path = tmp_path / tier_name("m", tensors)
    first.close()
    assert path.exists()
    second.close()
    other.close()
    assert not path.exists()
    again = HostTier.open("m", tensors, 0.001, directory=tmp_path)
    assert again.tier_id != first.tier_id  # a new file is a new tier: the scheduler trusts none of it
    again.close()


def test_a_tier_whose_workers_were_killed_is_removed_by_the_next_worker_to_start(tmp_path):
    tensors = _pool(torch.float32)
    held = HostTier.open("live", tensors, 0.001, directory=tmp_path)
    mine = HostTier.open("restarted", tensors, 0.001, directory=tmp_path)
    mine_id, mine_path = mine.tier_id, mine.path
    del mine.slots
    mine._mmap.close()  # as a SIGKILL leaves it: mapped by no one, not removed
    os.close(mine._fd)
    orphan = tmp_path / "switchyard-kv-0123456789abcdef"  # another stack's, its workers SIGKILLed
    orphan.write_bytes(b"\0" * 8192)
    try:
        assert sweep(tmp_path, keep=mine_path) == [orphan]
        assert held.path.exists() and mine_path.exists() and not orphan.exists()
        again = HostTier.open("restarted", tensors, 0.001, directory=tmp_path)
        assert again.tier_id == mine_id  # the worker back on its host: the scheduler's index still holds
        again.close()
    finally:
        held.close()


# ---- the real model: loaded prefixes give a lone run's tokens ----------------------------------------


def talk(loaded_model, engine: InProcessEngine, histories: list[list[int]], turns: int = 3) -> dict:
    """Every conversation a turn at a time, round robin, on `engine`; each history grows by the answer
    and 8 more random tokens. Returns what each prompt gives run alone on a pool that never evicts."""
    vocab = loaded_model.config.vocab_size
    lone = {}
    for turn in range(turns):
        for i, history in enumerate(histories):
            rid = f"c{i}-t{turn}"
            engine.add(rid, history, max_tokens=4)
            engine.run()
            alone = InProcessEngine(loaded_model, num_blocks=16, max_num_batched_tokens=64)
            alone.add(rid, history, max_tokens=4)
            lone[rid] = alone.run()[rid]
            history += engine.outputs[rid] + torch.randint(10, vocab, (8,)).tolist()
    return lone


def test_multi_turn_over_a_small_pool_hits_the_tier_and_matches_lone_runs(loaded_model, tmp_path):
    """Conversations whose KV is several times the pool: later turns load their history from the
    tier. Greedy tokens equal each prompt run alone on a pool that never evicts."""
    torch.manual_seed(0)
    vocab = loaded_model.config.vocab_size
    histories = [torch.randint(10, vocab, (40,)).tolist() for _ in range(3)]
    shape = InProcessEngine(loaded_model, num_blocks=8).runner.backend.kv_tensors()
    tier = HostTier.open("test-model", shape, 0.05, directory=tmp_path)
    try:
        engine_tier = InProcessEngine(loaded_model, num_blocks=8, max_num_batched_tokens=64, tier=tier)
        assert engine_tier.outputs == talk(loaded_model, engine_tier, histories)
        index = engine_tier.scheduler.kv.tier
        assert index.num_loaded > 0 and engine_tier.scheduler.kv.num_tier_hit_tokens > 0
        later = [engine_tier.num_cached_tokens[f"c{i}-t2"] for i in range(3)]
        assert all(n >= 32 for n in later), later  # each last turn started from its history's blocks
        assert engine_tier.scheduler.kv.pool.num_free == 8 and not index.pins and not index.pending
    finally:
        tier.close()


def test_computed_blocks_are_written_through_for_another_worker_of_the_host():
    """Not only evicted blocks: what a Step computed is saved by the next one, a Step of copies
    alone if nothing else runs, so a pool that never computed the prefix (another worker on the
    host, or this one restarted) loads it."""
    tier = TierIndex(HostTierInfo(tier_id="t", num_slots=8))
    first, second = (Scheduler(KVCacheManager(6, 4, root_hash("m", "auto"), tier=tier), 4, 64) for _ in range(2))
    first.add_request(req("a", 9, max_tokens=1))
    _step(first)
    assert first.has_work  # a's two blocks wait to be written
    plan, _ = _step(first)
    assert len(plan.step.kv_saves) == 2 and not plan.num_new_tokens and not first.has_work
    second.add_request(req("b", 9, max_tokens=1))
    plan, _ = _step(second)
    assert plan.step.new_seqs[0].num_computed_tokens == 8 and len(plan.step.kv_loads) == 2


def test_kv_transfer_params_need_the_tier_and_one_role():
    from services.scheduler.kv_holds import kv_transfer_error
    from shared.wire.kv_events import KvTransferParams

    tier = TierIndex(HostTierInfo(tier_id="t", num_slots=2))
    assert kv_transfer_error(None, [None]) is None
    assert "--kv-offloading-size" in kv_transfer_error(KvTransferParams(do_remote_decode=True), [None, None])
    assert kv_transfer_error(KvTransferParams(do_remote_decode=True), [None, tier]) is None
    assert "not both" in kv_transfer_error(KvTransferParams(do_remote_decode=True, do_remote_prefill=True), [tier])
