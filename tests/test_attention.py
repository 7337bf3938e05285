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


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_decode_as_loops_matches_the_matmuls(dtype, atol):
    """The compiled layers' decode attention (sums written as loops) against the reference's matmuls:
    ragged lengths, scattered blocks, the padding masked. bfloat16: the loops keep the scores in float32."""
    torch.manual_seed(0)
    lengths = [1, 17, 40, 64]
    num_blocks = 4
    k_cache = torch.randn(len(lengths) * num_blocks + 1, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM).to(dtype)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(len(lengths) * num_blocks)[:len(lengths) * num_blocks].view(len(lengths), num_blocks)
    meta = attention.AttentionMetadata(
        slot_mapping=torch.zeros(len(lengths), dtype=torch.long), decode_token_idx=torch.arange(len(lengths)),
        decode_block_tables=tables,
        decode_context_mask=(torch.arange(num_blocks * BLOCK_SIZE) < torch.tensor(lengths).unsqueeze(1)).view(
            len(lengths), 1, 1, -1),
        decode_context_lens=torch.tensor(lengths), prefills=[])
    q = torch.randn(len(lengths), NUM_KV_HEADS * GROUP, HEAD_DIM).to(dtype)

    loops = attention.decode_as_loops(q, k_cache, v_cache, meta, HEAD_DIM**-0.5)

    torch.testing.assert_close(loops, attention._decode(q, k_cache, v_cache, meta, HEAD_DIM**-0.5), atol=atol, rtol=0)
