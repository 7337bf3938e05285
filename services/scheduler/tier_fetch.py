"""Prefixes cached on another host: before a request joins a pool, the blocks of its prefix that
only another host's KV tier holds are copied into the pool's own tier by its worker (KvFetch, over
the bus), so the pool's prefix hits load them. A fetch that fails or times out changes nothing:
the request computes its prompt as it would have."""

from __future__ import annotations

from nats.aio.client import Client

from services.scheduler.pool import PoolLoop
from services.scheduler.request import Request
from shared.log import get_logger
from shared.wire import subjects
from shared.wire.hashing import max_cacheable_blocks
from shared.wire.kv_events import KV_FETCHED_DECODER, KvFetch
from shared.wire.messages import encode

log = get_logger("scheduler.tier_fetch")
FETCH_TIMEOUT_S = 30.0


async def fetch_remote_prefix(nc: Client, pool: PoolLoop, request: Request) -> int:
    """Copies what the pool reaches of the request's prefix only through another host's tier into
    its own; returns the blocks copied (0: nothing to fetch, or the fetch failed)."""
    tier, kv = pool.tier, pool.scheduler.kv
    if tier is None or not kv.enable_prefix_caching or not request.block_hashes:
        return 0
    hashes = request.block_hashes[:max_cacheable_blocks(request.num_tokens, kv.block_size)]
    local = kv.num_cached_blocks_of(hashes)
    local += tier.num_leading(hashes[local:])
    peer, run = tier.remote_run(hashes[local:])
    if peer is None or run == 0:
        return 0
    wanted, pairs = [], []
    for block_hash in hashes[local:local + run]:
        ours = tier.reserve(block_hash)
        if ours is None:  # every slot pinned or pending, or another pool fetches it now
            break
        theirs = peer.lookup(block_hash)
        peer.pin(theirs)
        wanted.append(block_hash)
        pairs.append((theirs, ours))
    if not pairs:
        return 0
    error = None
    try:
        reply = await nc.request(subjects.worker_kv_fetch(pool.worker_id), encode(KvFetch(peer.tier_id, pairs)),
                                 timeout=FETCH_TIMEOUT_S)
        error = KV_FETCHED_DECODER.decode(reply.data).error
    except Exception as exc:  # noqa: BLE001 - the worker or the bus: the request recomputes
        error = f"{type(exc).__name__}: {exc}"
    finally:
        for theirs, _ in pairs:
            peer.unpin(theirs)
    if error is not None:
        tier.abort(wanted)
        log.warning("kv_fetch_failed", request_id=request.request_id, worker_id=pool.worker_id,
                    from_tier=peer.tier_id, error=error)
        return 0
    tier.commit(wanted)
    log.info("kv_fetched", request_id=request.request_id, worker_id=pool.worker_id, from_tier=peer.tier_id,
             num_blocks=len(pairs))
    return len(pairs)
