"""Route a request to a worker pool: static-shape slots when it fits them, else the longest cached
prefix in a worker's pool (from the KV index), then the longest it reaches with its host KV tier,
then a worker already running its LoRA adapter, then least load."""

from __future__ import annotations

from nats.aio.client import Client

from services.scheduler.pool import PoolLoop
from shared.log import get_logger
from shared.wire import subjects
from shared.wire.kv_events import KV_LOOKUP_REPLY_DECODER, KvLookup
from shared.wire.messages import WorkerKind, encode

log = get_logger("scheduler.router")
LOOKUP_TIMEOUT_S = 0.05


class Router:
    def __init__(self, nc: Client, model: str):
        self.nc = nc
        self.model = model

    async def choose(self, pools: list[PoolLoop], block_hashes: list[bytes], lora: str | None = None) -> PoolLoop:
        """`pools` can all take the request. A static-shape (slots) worker with a free slot takes it
        first: its program runs every slot each step, so a filled slot is capacity otherwise idle.
        The rest (longer than its ctx_len, or arriving while every slot is taken: queued behind a
        slot, a short request waited seconds more for its first token, bench/qaic_mixed.py) go to
        paged workers by prefix cached in their pool, then by prefix they reach with their host tier
        (a block in the pool beats one in the tier, which beats one on another host: recomputed),
        then to one whose requests already run on the request's LoRA adapter (it is in that worker's
        slots), then by load; with no paged worker, to the least loaded."""
        static = [p for p in pools if p.hello.kind == WorkerKind.SLOTS and p.load < p.hello.num_blocks]
        if static:
            return min(static, key=lambda p: p.load)
        pools = [p for p in pools if p.hello.kind == WorkerKind.PAGED] or pools
        matches = await self._cached_blocks(pools, block_hashes) if len(pools) > 1 and block_hashes else {}

        def reach(pool: PoolLoop) -> tuple[int, int]:
            """Blocks it reaches with its host's tier, then with another host's too (copied over the bus)."""
            if pool.tier is None:
                return 0, 0
            local = matches.get(pool.worker_id, 0)
            local += pool.tier.num_leading(block_hashes[local:])
            return local, local + pool.tier.remote_run(block_hashes[local:])[1]

        return max(pools, key=lambda p: (matches.get(p.worker_id, 0), *(reach(p) if matches else (0, 0)),
                                         lora in p.loras_in_use, -p.load))

    async def _cached_blocks(self, pools: list[PoolLoop], block_hashes: list[bytes]) -> dict[str, int]:
        try:
            msg = await self.nc.request(subjects.KV_LOOKUP, encode(KvLookup(self.model, block_hashes)),
                                        timeout=LOOKUP_TIMEOUT_S)
            return KV_LOOKUP_REPLY_DECODER.decode(msg.data).num_matched_blocks
        except Exception as exc:  # the index is an optimisation: without it, route on our own pools
            log.warning("kv_lookup_failed", error=type(exc).__name__)
            return {p.worker_id: p.scheduler.kv.num_cached_blocks_of(block_hashes) for p in pools}
