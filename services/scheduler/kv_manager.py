"""What a pool's scheduler asks of its KV memory: paged blocks (KVCacheManager) or whole slots (SlotManager)."""

from __future__ import annotations

from typing import Protocol

from services.scheduler.request import Request
from shared.wire.messages import Step


class KVManager(Protocol):
    block_size: int  # tokens a block holds (a slot: its whole context)
    enable_prefix_caching: bool
    num_queried_tokens: int  # prompt tokens of admitted requests
    num_hit_tokens: int  # of which the prefix cache held
    num_tier_queried_tokens: int  # prompt tokens of admitted requests, with a host KV tier
    num_tier_hit_tokens: int  # of which the tier held

    def get_computed_blocks(self, request: Request) -> list:
        """The cached blocks a waiting request starts from (its prefix hits)."""

    def record_admission(self, num_tokens: int, hits: list, first: bool) -> None:
        """Prefix-cache statistics at an admission (hits: its get_computed_blocks; first: the request's first)."""

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether a sequence of this many tokens fits an empty pool."""

    def allocate_slots(self, request: Request, num_new_tokens: int, computed_blocks: list = ()) -> list | None:
        """Room for num_new_tokens more tokens: the new blocks, or None (and nothing changed)."""

    def free(self, request: Request) -> None:
        """Give back everything the request holds."""

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table, as the worker receives it."""

    def cached_hashes(self) -> list[bytes]:
        """Every block hash the pool holds (the KV index's resync)."""

    def num_cached_blocks_of(self, block_hashes: list[bytes]) -> int:
        """How many leading blocks of a prompt the pool holds (routing without the KV index)."""

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (its worker freed the KV pool); only while nothing runs."""

    @property
    def has_transfers(self) -> bool:
        """Copies to the host tier wait for the next Step, even with no request to run."""

    def take_transfers(self, step: Step) -> None:
        """The next Step's host-tier copies, into it: saves, loads, and the disk spill's."""

    def end_transfers(self, ok: bool) -> None:
        """The Step that carried them is back (ok) or lost."""

    def take_events(self) -> list:
        """Blocks stored and removed since the last call, for the KV index."""

    @property
    def usage(self) -> float:
        """The share of the pool in use, 0..1."""
