"""The paged attention's fast paths against plain SDPA over the same K/V (the torch reference)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.worker.backends.torch_cpu import attention
from services.worker.backends.torch_cpu.attention import _prefill

BLOCK_SIZE, NUM_KV_HEADS, GROUP, HEAD_DIM = 16, 3, 3, 64


@pytest.mark.parametrize("num_cached,num_query", [(512, 64), (16, 1), (5, 40), (100, 3)])
@pytest.mark.parametrize("fits", [True, False])  # False: past MATMUL_ATTENTION_MAX_SCORES, SDPA with a mask
def test_chunk_after_a_cached_prefix_matches_sdpa(monkeypatch, num_cached, num_query, fits):
    if not fits:
        monkeypatch.setattr(attention, "MATMUL_ATTENTION_MAX_SCORES", 0)
    torch.manual_seed(0)
    context = num_cached + num_query
    num_blocks = -(-context // BLOCK_SIZE)
    k_cache = torch.randn(num_blocks + 4, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM)
    v_cache = torch.randn_like(k_cache)
    block_ids = torch.randperm(num_blocks + 4)[:num_blocks]  # scattered, as in the pool
    q = torch.randn(num_query, NUM_KV_HEADS * GROUP, HEAD_DIM)

    out = _prefill(q, k_cache, v_cache, num_cached, block_ids, scale=HEAD_DIM**-0.5)

    def contiguous(cache):  # [h_kv, context, d], query head h reads KV head h // GROUP
        flat = cache[block_ids].transpose(0, 1).flatten(1, 2)[:, :context]
        return flat.repeat_interleave(GROUP, 0)

    positions = torch.arange(num_query).unsqueeze(1) + num_cached
    mask = torch.arange(context).unsqueeze(0) <= positions
    expected = F.scaled_dot_product_attention(q.transpose(0, 1), contiguous(k_cache), contiguous(v_cache),
                                              attn_mask=mask, scale=HEAD_DIM**-0.5).transpose(0, 1)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)


