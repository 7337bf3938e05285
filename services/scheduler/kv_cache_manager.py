"""Per-pool block allocation with automatic prefix caching (scheduler-local, never remote)."""

from __future__ import annotations

from services.scheduler.block_pool import BlockPool, KVBlock
from services.scheduler.host_tier import TierIndex
from services.scheduler.request import Request
from shared.wire.hashing import hash_block_chain, max_cacheable_blocks
from shared.wire.messages import Step


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class TierHit:
    """A prefix block the host tier (or its disk spill) holds: loaded into a new block of the pool,
    not recomputed."""

    __slots__ = ("block_hash", "slot", "on_disk")

    def __init__(self, block_hash: bytes, slot: int, on_disk: bool = False):
        self.block_hash = block_hash
        self.slot = slot  # the tier's, or the disk's
        self.on_disk = on_disk


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, root_hash: bytes, enable_prefix_caching: bool = True,
                 tier: TierIndex | None = None):
        """tier: the host tier the worker copies evicted blocks to (None: an evicted block is gone)."""
        self.tier = tier if enable_prefix_caching else None
        self.pool = BlockPool(num_blocks, self._offload if self.tier else None)
        self.block_size = block_size
        self.root_hash = root_hash
        self.enable_prefix_caching = enable_prefix_caching
        self.req_to_blocks: dict[str, list[KVBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # how many of a request's blocks carry a hash
        self.num_queried_tokens = 0  # prompt tokens of admitted requests
        self.num_hit_tokens = 0  # of which the pool held
        self.num_tier_queried_tokens = 0  # prompt tokens of admitted requests, with a host tier
        self.num_tier_hit_tokens = 0  # of which the tier held (past the pool's)
        self._saves: list[tuple[int, int, bytes]] = []  # this Step's (block id, slot, hash) into the tier
        self._loads: list[tuple[int, KVBlock]] = []  # ... (slot, block) out of it
        self._computed: list[tuple[KVBlock, bytes]] = []  # cached this Step: saved once its forward is done
        self._to_save: list[tuple[KVBlock, bytes]] = []  # ... by a Step that is back: the next Step saves them
        self._spills: list[tuple[int, int, bytes]] = []  # (slot, disk slot, hash): what the saves' slots held
        self._disk_loads: list[tuple[int, KVBlock]] = []  # (disk slot, block)
        self._in_flight: tuple[list, ...] = ([], [], [], [], [])  # the Step out's saves, loads, computed, spills, disk loads

    def update_block_hashes(self, request: Request) -> None:
        """Extend the request's hash chain over its full blocks (outputs included)."""
        start = len(request.block_hashes)
        if request.num_tokens // self.block_size > start:
            parent = request.block_hashes[-1] if start else None
            request.block_hashes.extend(hash_block_chain(
                self.root_hash, request.all_token_ids, self.block_size,
                cache_salt=request.cache_salt, lora=request.lora_identity, start_block=start, parent=parent,
                images=[(image.offset, image.end, image.key) for image in request.images]))

    def get_computed_blocks(self, request: Request) -> list[KVBlock | TierHit]:
        """Longest run of cached blocks at the start of the request (never its last token): those
        in the pool, then those the host tier holds."""
        if not self.enable_prefix_caching or request.sampling.prompt_logprobs is not None:
            return []  # prompt logprobs need every prompt position computed
        self.update_block_hashes(request)
        hashes = request.block_hashes[:max_cacheable_blocks(request.num_tokens, self.block_size)]
        hits: list[KVBlock | TierHit] = self.pool.cached_prefix(hashes)
        if self.tier is not None:
            disk = self.tier.disk
            for block_hash in hashes[len(hits):]:
                if (slot := self.tier.lookup(block_hash)) is not None:
                    hits.append(TierHit(block_hash, slot))
                elif disk is not None and (slot := disk.lookup(block_hash)) is not None:
                    hits.append(TierHit(block_hash, slot, on_disk=True))
                else:
                    break
        return hits

    def record_admission(self, num_tokens: int, hits: list[KVBlock | TierHit], first: bool) -> None:
        """Prefix-cache statistics count a request once, at its first admission (not per retry); the
        host tier's, as vLLM counts its KV connector's, at every admission (a handoff's included)."""
        num_tier_hits = sum(isinstance(hit, TierHit) for hit in hits)
        if first:
            self.num_queried_tokens += num_tokens
            self.num_hit_tokens += (len(hits) - num_tier_hits) * self.block_size
        if self.tier is not None:
            self.num_tier_queried_tokens += num_tokens
            self.num_tier_hit_tokens += num_tier_hits * self.block_size

    def can_ever_fit(self, num_tokens: int) -> bool:
        return cdiv(num_tokens, self.block_size) <= self.pool.num_blocks

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: list[KVBlock | TierHit] = ()) -> list[KVBlock] | None:
        """Blocks for `num_new_tokens` more tokens; None (and nothing changed) if they do not fit.
        The tier's hits take new blocks, loaded before the Step's forward."""
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        pool_hits = [b for b in computed_blocks if isinstance(b, KVBlock)]
        tier_hits = computed_blocks[len(pool_hits):]
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        num_needed = cdiv(num_computed + num_new_tokens, self.block_size) - len(blocks) - len(pool_hits)
        num_evictable_hits = sum(1 for b in pool_hits if b.ref_cnt == 0)
        if num_needed > self.pool.num_free - num_evictable_hits:
            return None
        self.pool.touch(pool_hits)
        blocks.extend(pool_hits)
        for hit in tier_hits:  # before the new blocks evict others into the tier: no save takes these slots
            (self.tier.disk if hit.on_disk else self.tier).pin(hit.slot)
        new_blocks = self.pool.get_new_blocks(max(num_needed, 0))
        for hit, block in zip(tier_hits, new_blocks, strict=False):
            (self._disk_loads if hit.on_disk else self._loads).append((hit.slot, block))
        blocks.extend(new_blocks)
        self._cache_full_blocks(request, num_computed + num_new_tokens)
        return new_blocks

    # ---- the host tier's transfers, one Step's at a time -------------------------------------------

    def _offload(self, block: KVBlock) -> None:
        """A cached block is handed out again: the Step saves it into the tier first (unless the tier
        has it, or the block is one this Step loads: its content then is not its hash's yet)."""
        if self._is_loaded(block):
            return
        self._save(block, block.block_hash)

    def _is_loaded(self, block: KVBlock) -> bool:
        return any(loaded is block for _, loaded in self._loads) or any(b is block for _, b in self._disk_loads)

    def _save(self, block: KVBlock, block_hash: bytes) -> None:
        """Into a slot of the tier; the block its LRU drops for it, to the disk first (if any)."""
        slot = self.tier.reserve(block_hash, spill=True)
        self._spills += self.tier.take_spills()
        if slot is not None:
            self._saves.append((block.block_id, slot, block_hash))

    @property
    def has_transfers(self) -> bool:
        """Blocks computed by the last Step wait to be written to the tier (a Step of copies alone)."""
        return bool(self._to_save)

    def take_transfers(self, step: Step) -> None:
        """This Step's (block, slot) saves and (slot, block) loads, with the disk's (slot, disk slot)
        spills and (disk slot, block) loads; in flight until end_transfers. Write-through: every
        block a Step computed is saved by the next one (a later turn, another worker on the host, or
        this one after a restart finds it), unless the tier has it already."""
        for block, block_hash in self._to_save:
            if block.block_hash == block_hash and not self._is_loaded(block):
                self._save(block, block_hash)
        self._in_flight = (self._saves, self._loads, self._computed, self._spills, self._disk_loads)
        self._saves, self._loads, self._computed, self._to_save, self._spills, self._disk_loads = [], [], [], [], [], []
        saves, loads, _, spills, disk_loads = self._in_flight
        step.kv_saves = [(block, slot) for block, slot, _ in saves]
        step.kv_loads = [(slot, block.block_id) for slot, block in loads]
        step.kv_spills = [(slot, disk_slot) for slot, disk_slot, _ in spills]
        step.kv_disk_loads = [(disk_slot, block.block_id) for disk_slot, block in disk_loads]

    def end_transfers(self, ok: bool) -> None:
        """The Step is back (ok), or failed / lost with its worker: then what it saved is dropped and
        what it loaded is no longer trusted as its hash's."""
        saves, loads, computed, spills, disk_loads = self._in_flight
        self._in_flight = ([], [], [], [], [])
        if self.tier is None:
            return
        for slot, _ in loads:
            self.tier.unpin(slot)
        for disk_slot, _ in disk_loads:
            self.tier.disk.unpin(disk_slot)
        spilled = [block_hash for _, _, block_hash in spills]
        if spilled and ok:
            self.tier.disk.commit(spilled)
        elif spilled:
            self.tier.disk.abort(spilled)
        if ok:
            self.tier.commit([block_hash for _, _, block_hash in saves])
            self.tier.num_loaded += len(loads) + len(disk_loads)
            if disk_loads:
                self.tier.disk.num_loaded += len(disk_loads)
            self._to_save += computed
        else:
            self.tier.abort([block_hash for _, _, block_hash in saves])
            for _, block in loads + disk_loads:
                self.pool.forget(block)

    def _cache_full_blocks(self, request: Request, num_tokens_after_step: int) -> None:
        if not self.enable_prefix_caching:
            return
        self.update_block_hashes(request)
        blocks = self.req_to_blocks[request.request_id]
        start = self.num_cached_blocks.get(request.request_id, 0)
        end = min(num_tokens_after_step // self.block_size, len(request.block_hashes))
        for i in range(start, end):
            if blocks[i].block_hash is None:
                parent = request.block_hashes[i - 1] if i else None
                self.pool.cache_block(blocks[i], request.block_hashes[i], parent)
                if self.tier is not None and blocks[i].block_hash is not None:
                    self._computed.append((blocks[i], blocks[i].block_hash))
        self.num_cached_blocks[request.request_id] = max(start, end)

    def free(self, request: Request) -> None:
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.pool.free_blocks(reversed(blocks))

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def cached_hashes(self) -> list[bytes]:
        return list(self.pool.cached)

    def num_cached_blocks_of(self, block_hashes: list[bytes]) -> int:
        """How many leading blocks of a prompt this pool holds (routing without the KV index)."""
        return len(self.pool.cached_prefix(block_hashes))

    def reset_prefix_cache(self) -> None:
        assert not self.req_to_blocks, "the prefix cache is reset only while no request holds a block"
        self.pool = BlockPool(self.pool.num_blocks, self.pool.on_evict)
        self.num_cached_blocks.clear()
        self._to_save.clear()

    def take_events(self):
        return self.pool.take_events()

    @property
    def usage(self) -> float:
        return self.pool.usage
