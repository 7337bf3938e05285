"""KV slots for a static-shape worker (QAIC): the paged manager's interface over fixed slots.

Such a worker compiles its KV cache as `[num_slots, kv_heads, ctx_len, head_dim]` per layer: a
sequence takes one whole slot from admission to its end, so there is nothing to page, share or
preempt. A slot's id travels in NewSeq.block_ids, alone, as a one-block table whose block holds
ctx_len tokens.
"""

from __future__ import annotations

from services.scheduler.request import Request


class SlotManager:
    enable_prefix_caching = False

    def __init__(self, num_slots: int, ctx_len: int):
        self.num_slots = num_slots
        self.block_size = ctx_len  # a slot is one block of ctx_len tokens
        self.free_slots = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first
        self.req_to_slot: dict[str, int] = {}
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0  # stays 0: no prefix caching across slots (yet)
        self.num_tier_queried_tokens = self.num_tier_hit_tokens = 0  # no host tier

    @property
    def ctx_len(self) -> int:
        return self.block_size

    @property
    def has_free_slot(self) -> bool:
        return bool(self.free_slots)

    def get_computed_blocks(self, request: Request) -> list:
        return []

    def record_admission(self, num_tokens: int, hits: list, first: bool) -> None:
        self.num_queried_tokens += num_tokens * first

    has_transfers = False

    def take_transfers(self, step) -> None:
        pass  # no host tier: a slot is a whole sequence's context

    def end_transfers(self, ok: bool) -> None:
        pass

    def can_ever_fit(self, num_tokens: int) -> bool:
        return num_tokens <= self.ctx_len

    def allocate_slots(self, request: Request, num_new_tokens: int, computed_blocks=()) -> list | None:
        """[] when the request has (or now takes) a slot with room for num_new_tokens more; else None."""
        if request.num_computed_tokens + num_new_tokens > self.ctx_len:
            return None
        if request.request_id not in self.req_to_slot:
            if not self.free_slots:
                return None
            self.req_to_slot[request.request_id] = self.free_slots.pop()
        return []

    def free(self, request: Request) -> None:
        slot = self.req_to_slot.pop(request.request_id, None)
        if slot is not None:
            self.free_slots.append(slot)

    def block_ids(self, request_id: str) -> list[int]:
        return [self.req_to_slot[request_id]] if request_id in self.req_to_slot else []

    def cached_hashes(self) -> list[bytes]:
        return []

    def num_cached_blocks_of(self, block_hashes: list[bytes]) -> int:
        return 0

    def reset_prefix_cache(self) -> None:
        """Nothing is cached across slots."""

    def take_events(self) -> list:
        return []

    @property
    def usage(self) -> float:
        return len(self.req_to_slot) / self.num_slots
