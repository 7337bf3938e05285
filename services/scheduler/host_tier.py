"""The host KV tier's index: which block hash sits in which slot of a host's shared memory, LRU.

The workers only copy (Step.kv_saves / kv_loads); the index is the scheduler's, shared by every
pool whose worker maps the same tier. A slot saved in a Step is readable once that Step's result
is back (pending until then); a slot loaded by a Step in flight is pinned, never reused under it.
With a disk spill (--kv-offloading-disk-size), what the LRU drops goes to the disk's slots
(Step.kv_spills), from which a prefix hit loads straight into the pool (Step.kv_disk_loads).
"""

from __future__ import annotations

from collections import Counter, OrderedDict

from shared.log import get_logger
from shared.wire.kv_events import BlockRemoved, BlockStored, HostTierInfo, KvEvent

log = get_logger("scheduler.host_tier")
MEDIUM = "host"  # the KV events' medium for this tier's blocks
DISK = "disk"  # ... and for its disk spill's


class SlotIndex:
    """Block hashes in the numbered slots of a file, LRU: a slot being written is pending until its
    Step is back, a slot a Step in flight reads is pinned; neither is ever handed out again."""

    medium = MEDIUM

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.free_slots = list(range(num_slots - 1, -1, -1))
        self.entries: OrderedDict[bytes, int] = OrderedDict()  # ready, least recently used first
        self.pending: dict[bytes, int] = {}  # written by a Step in flight
        self.pins: Counter[int] = Counter()  # slots loads in flight read
        self.events: list[KvEvent] = []
        self.num_loaded = 0  # blocks read back into a pool instead of recomputed

    def lookup(self, block_hash: bytes) -> int | None:
        return self.entries.get(block_hash)

    def reserve(self, block_hash: bytes, spill: bool = False) -> int | None:
        """A slot for a block to be written into, pending until committed; None: the index has it
        already (now most recently used), or is being given it, or every slot is pinned or pending.
        spill: what the LRU drops for it is kept further down (TierIndex: its disk)."""
        if block_hash in self.entries:
            self.entries.move_to_end(block_hash)
            return None
        if block_hash in self.pending:
            return None
        slot = self.free_slots.pop() if self.free_slots else self._evict(spill)
        if slot is not None:
            self.pending[block_hash] = slot
        return slot

    def _evict(self, spill: bool) -> int | None:
        victim = next((h for h, slot in self.entries.items() if self._evictable(h, slot)), None)
        if victim is None:
            return None
        self.events.append(BlockRemoved(block_hashes=[victim], medium=self.medium))
        slot = self.entries.pop(victim)
        if spill:
            self._spill(victim, slot)
        return slot

    def _evictable(self, block_hash: bytes, slot: int) -> bool:
        return not self.pins[slot]

    def _spill(self, block_hash: bytes, slot: int) -> None:
        pass  # dropped

    def pin(self, slot: int) -> None:
        self.pins[slot] += 1

    def unpin(self, slot: int) -> None:
        self.pins[slot] -= 1
        if not self.pins[slot]:
            del self.pins[slot]

    def commit(self, block_hashes: list[bytes]) -> None:
        """Their Step is back: the slots hold the blocks."""
        stored = []
        for block_hash in block_hashes:
            slot = self.pending.pop(block_hash, None)
            if slot is not None:
                self.entries[block_hash] = slot
                stored.append(block_hash)
        if stored:
            self.events.append(BlockStored(block_hashes=stored, medium=self.medium))

    def abort(self, block_hashes: list[bytes]) -> None:
        """Their Step failed or its worker is gone: what the slots hold is unknown, they are free."""
        for block_hash in block_hashes:
            slot = self.pending.pop(block_hash, None)
            if slot is not None:
                self.free_slots.append(slot)

    def take_events(self) -> list[KvEvent]:
        events, self.events = self.events, []
        return events


class DiskIndex(SlotIndex):
    """The tier's disk spill: what the tier's LRU drops, loaded from there straight into a pool."""

    medium = DISK


class TierIndex(SlotIndex):
    def __init__(self, info: HostTierInfo, peers: HostTiers | None = None):
        """peers: every tier of the model's workers, on any host (those of this one's layout lend it slots)."""
        super().__init__(info.num_slots)
        self.tier_id = info.tier_id
        self.layout = info.layout
        self.registry = peers
        self.held: Counter[bytes] = Counter()  # blocks a decode request will load (kv_holds.py): never evicted
        self.disk = DiskIndex(info.disk_slots) if info.disk_slots else None
        self.spills: list[tuple[int, int, bytes]] = []  # (slot, disk slot, hash): the reserving pool's Step copies them

    @property
    def pool_id(self) -> str:
        """Its name among the pools of the KV index (its disk spill's: disk:<tier id>)."""
        return f"host:{self.tier_id}"

    @property
    def disk_pool_id(self) -> str:
        return f"disk:{self.tier_id}"

    def num_leading(self, block_hashes: list[bytes]) -> int:
        """How many of these hashes, from the first, the tier holds."""
        n = 0
        for block_hash in block_hashes:
            if block_hash not in self.entries:
                break
            n += 1
        return n

    def peers(self) -> list[TierIndex]:
        """The model's tiers on other hosts whose slots hold what ours do (the same layout)."""
        return [t for t in self.registry or () if t is not self and t.layout == self.layout and self.layout]

    def remote_run(self, block_hashes: list[bytes]) -> tuple[TierIndex | None, int]:
        """The tier on another host holding the longest run of these hashes from the first, and its length."""
        return max(((peer, peer.num_leading(block_hashes)) for peer in self.peers()), key=lambda p: p[1],
                   default=(None, 0))

    def _evictable(self, block_hash: bytes, slot: int) -> bool:
        return not self.pins[slot] and not self.held[block_hash]

    def _spill(self, block_hash: bytes, slot: int) -> None:
        """To the disk (self.spills, which the reserving pool's Step copies before its saves reuse the slot)."""
        if self.disk is not None and (disk_slot := self.disk.reserve(block_hash)) is not None:
            self.spills.append((slot, disk_slot, block_hash))

    def take_spills(self) -> list[tuple[int, int, bytes]]:
        spills, self.spills = self.spills, []
        return spills

    def protect(self, block_hashes: list[bytes]) -> None:
        self.held.update(block_hashes)

    def unprotect(self, block_hashes: list[bytes]) -> None:
        self.held.subtract(block_hashes)
        self.held = +self.held


class HostTiers:
    """A model's tiers by id: the pools of workers that map one file share its index, and it
    outlives them (a worker restarted on the host finds its prefixes still there)."""

    def __init__(self):
        self._tiers: dict[str, TierIndex] = {}

    def get(self, info: HostTierInfo | None) -> TierIndex | None:
        if info is None:
            return None
        tier = self._tiers.get(info.tier_id)
        if tier is None:
            tier = self._tiers[info.tier_id] = TierIndex(info, self)
            log.info("kv_tier_joined", tier_id=info.tier_id, path=info.path, num_slots=info.num_slots,
                     slot_mib=round(info.slot_bytes / 2**20, 3), layout=info.layout)
        return tier

    def __iter__(self):
        return iter(list(self._tiers.values()))
