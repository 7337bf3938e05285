"""The cluster KV index: which pool holds which block hashes, from the schedulers' KV events."""

from __future__ import annotations

from collections import defaultdict

from shared.wire.kv_events import BlockRemoved, BlockStored, KvEventBatch, PoolCleared


class KvIndex:
    def __init__(self):
        self.hashes_by_pool: dict[str, set[bytes]] = defaultdict(set)
        self.model_by_pool: dict[str, str] = {}

    def apply(self, batch: KvEventBatch) -> None:
        held = self.hashes_by_pool[batch.pool]
        self.model_by_pool[batch.pool] = batch.model
        for event in batch.events:
            if isinstance(event, BlockStored):
                held.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                held.difference_update(event.block_hashes)
            elif isinstance(event, PoolCleared):
                held.clear()

    def longest_prefix(self, model: str, block_hashes: list[bytes]) -> dict[str, int]:
        """Per pool of `model`: how many leading blocks of the chain it holds."""
        matches = {}
        for pool, held in self.hashes_by_pool.items():
            if self.model_by_pool.get(pool) != model:
                continue
            n = 0
            for block_hash in block_hashes:
                if block_hash not in held:
                    break
                n += 1
            matches[pool] = n
        return matches

    def num_blocks_by_pool(self) -> dict[str, int]:
        return {pool: len(held) for pool, held in self.hashes_by_pool.items()}
