"""Block manager: exact block ids, ref counts, hashes, and eviction order."""

from __future__ import annotations

from services.scheduler.block_pool import BlockPool
from services.scheduler.kv_cache_manager import KVCacheManager
from services.scheduler.request import Request
from shared.wire.hashing import hash_block_chain, root_hash
from shared.wire.kv_events import BlockRemoved, BlockStored
from shared.wire.messages import SamplingParams

ROOT = root_hash("m", "auto")


def req(request_id: str, tokens: list[int], max_tokens: int = 8) -> Request:
    return Request(request_id, tokens, SamplingParams(max_tokens=max_tokens), reply_to="")


def test_free_queue_order_uncached_front_cached_back_tail_first():
    pool = BlockPool(6)
    a = pool.get_new_blocks(3)
    assert [b.block_id for b in a] == [0, 1, 2]
    assert pool.free_queue.block_ids() == [3, 4, 5]
    pool.cache_block(a[0], b"h0", None)
    pool.cache_block(a[1], b"h1", b"h0")
    pool.free_blocks(reversed(a))  # tail first: 2 (uncached) to the front, then 1, 0 (cached) to the back
    assert pool.free_queue.block_ids() == [2, 3, 4, 5, 1, 0]
    assert [b.ref_cnt for b in pool.blocks] == [0] * 6


def test_allocation_evicts_cached_blocks_last_and_reports_it():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(2)
    pool.cache_block(blocks[0], b"h0", None)
    pool.cache_block(blocks[1], b"h1", b"h0")
    pool.free_blocks(reversed(blocks))
    assert pool.free_queue.block_ids() == [2, 3, 1, 0]
    pool.take_events()
    got = pool.get_new_blocks(3)
    assert [b.block_id for b in got] == [2, 3, 1]  # the tail block (h1) goes before the prefix (h0)
    assert b"h1" not in pool.cached and pool.cached[b"h0"] is blocks[0]
    assert pool.take_events() == [BlockRemoved(block_hashes=[b"h1"])]


def test_prefix_hit_takes_references_and_revives_free_blocks():
    kv = KVCacheManager(num_blocks=8, block_size=4, root_hash=ROOT)
    a = req("a", list(range(10)))  # 2 full blocks + 2 tokens
    assert kv.get_computed_blocks(a) == []
    new = kv.allocate_slots(a, 10)
    assert [b.block_id for b in new] == [0, 1, 2]
    hashes = hash_block_chain(ROOT, list(range(10)), 4)
    assert a.block_hashes == hashes
    assert [kv.pool.blocks[i].block_hash for i in range(3)] == [hashes[0], hashes[1], None]
    assert kv.pool.take_events() == [BlockStored([hashes[0]], None), BlockStored([hashes[1]], hashes[0])]

    b = req("b", list(range(9)) + [99])  # same first 2 blocks
    hits = kv.get_computed_blocks(b)
    assert [h.block_id for h in hits] == [0, 1]
    new_b = kv.allocate_slots(b, 2, hits)
    assert [x.block_id for x in new_b] == [3]
    assert [kv.pool.blocks[i].ref_cnt for i in range(4)] == [2, 2, 1, 1]

    kv.free(a)
    kv.free(b)
    assert [blk.ref_cnt for blk in kv.pool.blocks[:4]] == [0, 0, 0, 0]
    # uncached 3 then 2 went to the front; cached 1 then 0 to the back (b freed them last)
    assert kv.pool.free_queue.block_ids() == [3, 2, 4, 5, 6, 7, 1, 0]
    c = req("c", list(range(8)) + [5, 6])
    hits = kv.get_computed_blocks(c)
    assert [h.block_id for h in hits] == [0, 1]  # revived from the free queue
    kv.allocate_slots(c, 2, hits)
    assert kv.pool.free_queue.block_ids() == [2, 4, 5, 6, 7]


def test_last_prompt_token_is_never_a_hit():
    kv = KVCacheManager(num_blocks=8, block_size=4, root_hash=ROOT)
    a = req("a", list(range(8)))
    kv.allocate_slots(a, 8)
    b = req("b", list(range(8)))  # identical, exactly 2 blocks: only 1 may hit
    assert len(kv.get_computed_blocks(b)) == 1


def test_allocation_that_does_not_fit_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=4, root_hash=ROOT)
    a = req("a", list(range(8)))
    kv.allocate_slots(a, 8)
    b = req("b", [50, 51, 52, 53, 54, 55, 56, 57])
    assert kv.allocate_slots(b, 8) is None
    assert kv.pool.num_free == 1 and kv.block_ids("b") == []


def test_prefix_caching_off_never_hashes_or_hits():
    kv = KVCacheManager(num_blocks=8, block_size=4, root_hash=ROOT, enable_prefix_caching=False)
    a = req("a", list(range(10)))
    kv.allocate_slots(a, 10)
    assert a.block_hashes == [] and kv.pool.take_events() == []
    b = req("b", list(range(10)))
    assert kv.get_computed_blocks(b) == []
