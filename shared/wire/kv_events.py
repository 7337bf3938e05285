"""KV events and the cluster index's messages: what a scheduler tells the KV-cache service about its
pools' blocks (sy.v1.kv.events.<pool>), the lookups, stats and resync the service answers, and the
host KV tiers' copies between hosts (a worker reads another host's tier over the bus)."""

from __future__ import annotations

from typing import Union

import msgspec

BlockHash = bytes  # shared/wire/hashing.py's sha256 digests


class BlockStored(msgspec.Struct, tag="stored"):
    block_hashes: list[BlockHash]
    # the block before the first of them (None: they start the chain). Our index needs none (each
    # hash chains its parent's); it is DESIGN.md's contract for consumers that build a tree of
    # prefixes from the events, as vLLM's KV-event consumers do
    parent_hash: BlockHash | None = None
    medium: str | None = None  # where they are, as vLLM's events say: None, a worker's pool; "host": the host tier


class BlockRemoved(msgspec.Struct, tag="removed"):
    block_hashes: list[BlockHash]
    medium: str | None = None


class PoolCleared(msgspec.Struct, tag="cleared"):
    pass


KvEvent = Union[BlockStored, BlockRemoved, PoolCleared]


class KvEventBatch(msgspec.Struct, tag="kv_events"):
    pool: str
    model: str
    events: list[KvEvent]


class KvLookup(msgspec.Struct, tag="kv_lookup"):
    model: str
    block_hashes: list[BlockHash]


class KvLookupReply(msgspec.Struct, tag="kv_lookup_reply"):
    num_matched_blocks: dict[str, int]  # pool -> longest cached prefix, in blocks


class KvStatsRequest(msgspec.Struct, tag="kv_stats"):
    pass


class KvStatsReply(msgspec.Struct, tag="kv_stats_reply"):
    num_blocks_by_pool: dict[str, int]
    model_by_pool: dict[str, str]


class Resync(msgspec.Struct, tag="resync"):
    pass


class HostTierInfo(msgspec.Struct):
    """A worker's host KV tier: shared memory every worker of its model on the host maps."""

    tier_id: str  # the file's identity: workers announcing the same id share its slots
    num_slots: int  # KV blocks it holds
    path: str = ""  # for the logs
    layout: str = ""  # a digest of a slot's layout: tiers of one layout (on other hosts) copy slots between them
    slot_bytes: int = 0
    disk_slots: int = 0  # its spill on a local disk (--kv-offloading-disk-size): blocks its LRU drops go there


class TierRead(msgspec.Struct, tag="tier_read", array_like=True):
    """Bytes [offset, offset + length) of one slot of a host KV tier (a block of at most max_payload)."""

    slot: int
    offset: int
    length: int


class KvFetch(msgspec.Struct, tag="kv_fetch"):
    """Copy slots of another host's tier (tier_id) into this worker's own: (their slot, our slot)."""

    tier_id: str
    slots: list[tuple[int, int]]


class KvFetched(msgspec.Struct, tag="kv_fetched"):
    error: str | None = None  # None: every slot copied


class KvTransferParams(msgspec.Struct, frozen=True):
    """vLLM's kv_transfer_params, as an outside router drives disaggregated prefill with them:
    do_remote_decode on the prefill request (its prompt's blocks are held in the host tier for the
    decode request); do_remote_prefill with the prefill's answer on the decode request (it loads them)."""

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: str = ""  # the host tier holding the blocks
    remote_request_id: str = ""  # the prefill request, whose hold the decode request releases
    remote_block_ids: list[int] = []  # the tier's slots


class KvHeldQuery(msgspec.Struct, tag="kv_held_query"):
    """Gateway -> scheduler, after a do_remote_decode request ended at its length: where are its blocks?"""

    request_id: str


class KvHeld(msgspec.Struct, tag="kv_held"):
    tier_id: str = ""
    slots: list[int] = []  # the prompt's full blocks, in order, held until the decode request loads them
    error: str | None = None  # nothing held (never asked for, expired, or another scheduler's)


KV_EVENT_BATCH_DECODER = msgspec.msgpack.Decoder(KvEventBatch)
TIER_READ_DECODER = msgspec.msgpack.Decoder(TierRead)
KV_FETCH_DECODER = msgspec.msgpack.Decoder(KvFetch)
KV_FETCHED_DECODER = msgspec.msgpack.Decoder(KvFetched)
KV_HELD_QUERY_DECODER = msgspec.msgpack.Decoder(KvHeldQuery)
KV_HELD_DECODER = msgspec.msgpack.Decoder(KvHeld)
KV_LOOKUP_DECODER = msgspec.msgpack.Decoder(KvLookup)
KV_LOOKUP_REPLY_DECODER = msgspec.msgpack.Decoder(KvLookupReply)
KV_STATS_REPLY_DECODER = msgspec.msgpack.Decoder(KvStatsReply)
