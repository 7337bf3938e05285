"""Prefix hashes: exact chain values, salts, and the same hash in another process."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import msgspec

from shared.wire.hashing import hash_block_chain, max_cacheable_blocks, root_hash

ROOT = root_hash("SmolLM2-135M-Instruct", "auto")


def test_chain_is_sha256_of_msgpack_parent_tokens_extra():
    tokens = list(range(40))
    hashes = hash_block_chain(ROOT, tokens, 16)
    assert len(hashes) == 2  # full blocks only: 40 tokens = 2 full blocks + 8
    enc = msgspec.msgpack.encode
    h0 = hashlib.sha256(enc([ROOT, tokens[:16], []])).digest()
    h1 = hashlib.sha256(enc([h0, tokens[16:32], []])).digest()
    assert hashes == [h0, h1]


def test_resuming_the_chain_gives_the_same_hashes():
    tokens = list(range(64))
    whole = hash_block_chain(ROOT, tokens, 16)
    tail = hash_block_chain(ROOT, tokens, 16, start_block=2, parent=whole[1])
    assert whole[2:] == tail


def test_models_dtypes_and_salts_never_share_blocks():
    tokens = list(range(32))
    base = hash_block_chain(ROOT, tokens, 16)
    assert hash_block_chain(root_hash("other-model", "auto"), tokens, 16)[0] != base[0]
    assert hash_block_chain(root_hash("SmolLM2-135M-Instruct", "bfloat16"), tokens, 16)[0] != base[0]
    salted = hash_block_chain(ROOT, tokens, 16, cache_salt="tenant-a")
    assert salted[0] != base[0] and salted[1] != base[1]


def test_lookup_never_covers_the_last_token():
    assert max_cacheable_blocks(32, 16) == 1
    assert max_cacheable_blocks(33, 16) == 2
    assert max_cacheable_blocks(1, 16) == 0


def test_same_hash_in_another_process():
    code = ("from shared.wire.hashing import hash_block_chain, root_hash;"
            "print(hash_block_chain(root_hash('SmolLM2-135M-Instruct', 'auto'), list(range(48)), 16)[-1].hex())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "12345", "PYTHONPATH": "."}).stdout.strip()
    assert out == hash_block_chain(ROOT, list(range(48)), 16)[-1].hex()
