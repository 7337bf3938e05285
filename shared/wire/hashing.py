"""Prefix-cache block hashes: identical in every process (sha256 over msgpack, never `hash()`)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import msgspec

HASH_VERSION = "switchyard-prefix-v1"
_encode = msgspec.msgpack.Encoder().encode


def root_hash(model_id: str, kv_cache_dtype: str) -> bytes:
    """Seed of every chain: models (and KV dtypes) never share blocks."""
    return hashlib.sha256(_encode([HASH_VERSION, model_id, kv_cache_dtype])).digest()


def hash_block(parent: bytes, token_ids: Sequence[int], extra_keys: Sequence[str] = ()) -> bytes:
    return hashlib.sha256(_encode([parent, list(token_ids), list(extra_keys)])).digest()


def hash_block_chain(
    root: bytes,
    token_ids: Sequence[int],
    block_size: int,
    *,
    cache_salt: str | None = None,
    lora: str | None = None,
    start_block: int = 0,
    parent: bytes | None = None,
    images: Sequence[tuple[int, int, str]] = (),
) -> list[bytes]:
    """Hashes of the full blocks of `token_ids`, from `start_block` on.

    hash_i = sha256(msgpack([hash_{i-1}, tokens of block i, extra_keys])); block 0's extra keys
    carry the tenant's cache_salt so tenants never share (or time) each other's blocks, and the
    LoRA adapter's name, so two adapters (or an adapter and the base) never share KV. `images`:
    (start, end, key) of each image's tokens, whose key joins the extra keys of every block they
    touch: the same text with another image never shares KV, the same image does.
    """
    hashes: list[bytes] = []
    prev = root if start_block == 0 else parent
    assert prev is not None, "parent hash required when starting past block 0"
    first = tuple(key for key in (cache_salt, f"lora:{lora}" if lora else None) if key)
    for i in range(start_block, len(token_ids) // block_size):
        begin, end = i * block_size, (i + 1) * block_size
        extra = (*(first if i == 0 else ()), *(f"image:{key}" for s, e, key in images if s < end and e > begin))
        prev = hash_block(prev, token_ids[begin:end], extra)
        hashes.append(prev)
    return hashes


def max_cacheable_blocks(num_tokens: int, block_size: int) -> int:
    """A lookup matches at most (n-1)//block_size blocks: the last prompt token is always
    recomputed because its logits are needed."""
    return max(num_tokens - 1, 0) // block_size
