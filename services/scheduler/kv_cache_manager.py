"""Per-pool block allocation with automatic prefix caching (scheduler-local, never remote)."""

from __future__ import annotations

from services.scheduler.block_pool import BlockPool, KVBlock
from services.scheduler.request import Request
from shared.wire.hashing import hash_block_chain, max_cacheable_blocks


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, root_hash: bytes, enable_prefix_caching: bool = True):
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.root_hash = root_hash
        self.enable_prefix_caching = enable_prefix_caching
        self.req_to_blocks: dict[str, list[KVBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # how many of a request's blocks carry a hash
        self.num_queried_tokens = 0  # prompt tokens of admitted requests
        self.num_hit_tokens = 0  # of which came from the prefix cache

    def update_block_hashes(self, request: Request) -> None:
        """Extend the request's hash chain over its full blocks (outputs included)."""
        start = len(request.block_hashes)
        if request.num_tokens // self.block_size > start:
            parent = request.block_hashes[-1] if start else None
            request.block_hashes.extend(hash_block_chain(
                self.root_hash, request.all_token_ids, self.block_size,
                cache_salt=request.cache_salt, lora=request.lora_identity, start_block=start, parent=parent,
                images=[(image.offset, image.end, image.key) for image in request.images]))

    def get_computed_blocks(self, request: Request) -> list[KVBlock]:
        """Longest run of cached blocks at the start of the request (never its last token)."""
        if not self.enable_prefix_caching or request.sampling.prompt_logprobs is not None:
            return []  # prompt logprobs need every prompt position computed
        self.update_block_hashes(request)
        limit = max_cacheable_blocks(request.num_tokens, self.block_size)
        return self.pool.cached_prefix(request.block_hashes[:limit])

    def record_admission(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Prefix-cache statistics count a request once, when it is admitted (not per retry)."""
        self.num_queried_tokens += num_tokens
        self.num_hit_tokens += num_hit_tokens

    def can_ever_fit(self, num_tokens: int) -> bool:
        return cdiv(num_tokens, self.block_size) <= self.pool.num_blocks

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: list[KVBlock] = ()) -> list[KVBlock] | None:
        """Blocks for `num_new_tokens` more tokens; None (and nothing changed) if they do not fit."""
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        num_needed = cdiv(num_computed + num_new_tokens, self.block_size) - len(blocks) - len(computed_blocks)
        num_evictable_hits = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if num_needed > self.pool.num_free - num_evictable_hits:
            return None
        self.pool.touch(computed_blocks)
        blocks.extend(computed_blocks)
        new_blocks = self.pool.get_new_blocks(max(num_needed, 0))
        blocks.extend(new_blocks)
        self._cache_full_blocks(request, num_computed + num_new_tokens)
        return new_blocks

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
        self.pool = BlockPool(self.pool.num_blocks)
        self.num_cached_blocks.clear()

    def take_events(self):
        return self.pool.take_events()

    @property
    def usage(self) -> float:
        return self.pool.usage
