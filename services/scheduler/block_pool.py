"""KV blocks, their free queue (O(1) removal) and the prefix-cache map from hash to block.

Eviction order: a freed block without a hash goes to the front (reused first), one with a hash to
the back; a request frees its blocks tail-first. So allocation takes uncached blocks first, then
the least recently freed cached ones, tails before prefixes. A freed block keeps its hash and is
revived by a later hit until it is handed out again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from shared.wire.kv_events import BlockRemoved, BlockStored, KvEvent


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list threaded through the blocks themselves."""

    def __init__(self, blocks: Iterable[KVBlock]):
        self.head: KVBlock | None = None
        self.tail: KVBlock | None = None
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def append(self, block: KVBlock) -> None:
        block.prev_free, block.next_free = self.tail, None
        if self.tail is None:
            self.head = block
        else:
            self.tail.next_free = block
        self.tail = block
        self.num_free += 1

    def appendleft(self, block: KVBlock) -> None:
        block.prev_free, block.next_free = None, self.head
        if self.head is None:
            self.tail = block
        else:
            self.head.prev_free = block
        self.head = block
        self.num_free += 1

    def remove(self, block: KVBlock) -> None:
        if block.prev_free is None:
            self.head = block.next_free
        else:
            block.prev_free.next_free = block.next_free
        if block.next_free is None:
            self.tail = block.prev_free
        else:
            block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def popleft(self) -> KVBlock:
        if self.head is None:
            raise RuntimeError("no free block")
        block = self.head
        self.remove(block)
        return block

    def block_ids(self) -> list[int]:
        ids, block = [], self.head
        while block is not None:
            ids.append(block.block_id)
            block = block.next_free
        return ids


class BlockPool:
    def __init__(self, num_blocks: int, on_evict: Callable[[KVBlock], None] | None = None):
        """on_evict: told of each cached block before it is handed out again (the host tier saves it)."""
        self.on_evict = on_evict
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, KVBlock] = {}
        self.events: list[KvEvent] = []

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return self.free_queue.num_free

    def cached_prefix(self, block_hashes: Iterable[bytes]) -> list[KVBlock]:
        """The blocks of the longest run of `block_hashes`, from the start, that are cached."""
        hits = []
        for block_hash in block_hashes:
            block = self.cached.get(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        if n > self.num_free:
            raise RuntimeError(f"asked for {n} blocks, {self.num_free} free")
        blocks = []
        for _ in range(n):
            block = self.free_queue.popleft()
            self._maybe_evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """A prefix hit takes a reference; a free cached block leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks_tail_first: Iterable[KVBlock]) -> None:
        for block in blocks_tail_first:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)

    def cache_block(self, block: KVBlock, block_hash: bytes, parent_hash: bytes | None) -> None:
        if block_hash in self.cached:
            return  # identical content already cached in another block; this one stays private
        block.block_hash = block_hash
        self.cached[block_hash] = block
        self.events.append(BlockStored(block_hashes=[block_hash], parent_hash=parent_hash))

    def _maybe_evict(self, block: KVBlock) -> None:
        if block.block_hash is None:
            return
        if self.on_evict is not None:
            self.on_evict(block)
        self.forget(block)

    def forget(self, block: KVBlock) -> None:
        """The block's content is no longer its hash's."""
        if block.block_hash is None:
            return
        if self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
        self.events.append(BlockRemoved(block_hashes=[block.block_hash]))
        block.block_hash = None

    def take_events(self) -> list[KvEvent]:
        events, self.events = self.events, []
        return events

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks
