"""The host KV pool: zeroed, writable, resident only as its blocks are written, handed back with its tensors."""

from __future__ import annotations

import gc

import torch

from bench.memory import private_rss_bytes, status_mib
from services.worker.backends.kv_pool import KVSpec


def test_a_gib_pool_starts_zeroed_and_becomes_resident_as_its_blocks_are_written():
    kv = KVSpec(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32)
    num_blocks = kv.num_blocks_for_budget(2**30)
    before, private_before = status_mib(), private_rss_bytes() / 2**20
    caches = kv.allocate(num_blocks)
    assert status_mib() - before < 64  # nothing of the GiB is touched at start
    assert len(caches) == 4 and all(t.shape == (num_blocks + 1, 2, 16, 64) and t.dtype == torch.float32
                                    for pair in caches for t in pair)
    k0, v0 = caches[0]
    assert k0.data_ptr() != v0.data_ptr() and k0.is_contiguous()
    assert torch.count_nonzero(k0[:1000]) == 0 and torch.count_nonzero(v0[-1]) == 0  # the kernel's zero pages
    k0[7] = 1.5  # a block written: the others stay zero, the other tensors untouched
    assert torch.all(k0[7] == 1.5) and torch.count_nonzero(k0) == k0[7].numel() and torch.count_nonzero(v0) == 0
    for k, v in caches:  # every block written: the GiB resident, then handed back with the tensors (sleep mode)
        k.fill_(1.0), v.fill_(1.0)
    assert status_mib() - before > 900
    assert private_rss_bytes() / 2**20 - private_before < 64  # shared memory: the leak checks' measure leaves it out
    del caches, k0, v0, k, v
    gc.collect()
    assert status_mib() - before < 64


def test_a_pool_in_half_precision_and_an_empty_one():
    kv = KVSpec(num_layers=2, num_kv_heads=1, head_dim=8, block_size=4, dtype=torch.bfloat16)
    [(k, v), _] = kv.allocate(3)
    assert k.dtype == torch.bfloat16 and k.shape == (4, 1, 4, 8) and torch.count_nonzero(v) == 0
    k += 1
    assert torch.all(k == 1)
    assert KVSpec(1, 0, 8, 4, torch.float16).allocate(3)[0][0].numel() == 0
