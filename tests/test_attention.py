"""The paged attention's fast paths against plain SDPA over the same K/V (the torch reference)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from services.worker.backends.torch_cpu import attention
from services.worker.backends.torch_cpu.attention import _prefill

BLOCK_SIZE, NUM_KV_HEADS, GROUP, HEAD_DIM = 16, 3, 3, 64


def _noted(taken: list[str], name: str, path, *args):
    taken.append(name)
    return path(*args)


@pytest.mark.parametrize("num_cached,num_query", [(512, 64), (16, 1), (5, 40), (100, 3), (1, 16), (700, 300)])
@pytest.mark.parametrize("path", ["as_it_falls", "matmuls", "flash_merged"])
def test_chunk_after_a_cached_prefix_matches_sdpa(monkeypatch, num_cached, num_query, path):
    """Whichever path a chunk takes: the grouped matmuls (up to MATMUL_ATTENTION_MAX_QUERIES) or the
    flash kernel over the prefix and over the chunk, merged by log-sum-exp."""
    if path == "matmuls":
        monkeypatch.setattr(attention, "MATMUL_ATTENTION_MAX_QUERIES", num_query)
    elif path == "flash_merged":
        monkeypatch.setattr(attention, "MATMUL_ATTENTION_MAX_QUERIES", 0)
    taken = []
    for name in ("_matmul_attention", "_prefix_then_chunk"):
        monkeypatch.setattr(attention, name, functools.partial(_noted, taken, name, getattr(attention, name)))
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
    wanted = {"matmuls": "_matmul_attention", "flash_merged": "_prefix_then_chunk",
              "as_it_falls": "_matmul_attention" if num_query <= 16 else "_prefix_then_chunk"}[path]
    assert taken == [wanted]




@pytest.mark.parametrize("window,softcap", [(1, None), (7, None), (16, None), (40, None), (None, 1.5), (16, 1.5)])
def test_sliding_window_and_soft_capped_rows_match_plain_attention(window, softcap):
    """Decode rows and prefill chunks (fresh, and after a cached prefix) of a sliding-window or a
    soft-capped layer against attention over the whole context, written out: transformers' window
    mask (keys (i - window, i]) and its cap (scores -> cap * tanh(scores / cap))."""
    torch.manual_seed(window or 0)
    rows = [(0, 1), (30, 1), (70, 1), (0, 45), (33, 20), (3, 9)]  # (num_cached, num_new)
    num_blocks = sum(-(-(c + n) // BLOCK_SIZE) for c, n in rows)
    k_cache = torch.randn(num_blocks + 1, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM)
    v_cache = torch.randn_like(k_cache)
    order, tables = torch.randperm(num_blocks).tolist(), []
    for c, n in rows:
        needed = -(-(c + n) // BLOCK_SIZE)
        tables.append(order[:needed])
        order = order[needed:]
    q = torch.randn(sum(n for _, n in rows), NUM_KV_HEADS * GROUP, HEAD_DIM)
    decodes = [(i, r, t) for i, (r, t) in enumerate(zip(rows, tables, strict=True)) if r[1] == 1]
    width = max(len(t) for *_, t in decodes)
    lens = torch.tensor([c + 1 for _, (c, _), _ in decodes])
    starts = [sum(n for _, n in rows[:i]) for i in range(len(rows))]
    meta = attention.AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long),
        decode_token_idx=torch.tensor([starts[i] for i, *_ in decodes]),
        decode_block_tables=torch.tensor([t + [num_blocks] * (width - len(t)) for *_, t in decodes]),
        decode_context_mask=(torch.arange(width * BLOCK_SIZE)[None, :] < lens[:, None]).view(len(decodes), 1, 1, -1),
        decode_context_lens=lens,
        prefills=[(starts[i], n, c, torch.tensor(tables[i])) for i, (c, n) in enumerate(rows) if n > 1])
    out = attention.paged_attention(q, k_cache, v_cache, meta, HEAD_DIM**-0.5, window=window, softcap=softcap)

    for i, (num_cached, num_new) in enumerate(rows):
        context = num_cached + num_new

        def flat(cache, table=tables[i], context=context):  # [heads, context, d]
            return cache[table].transpose(0, 1).flatten(1, 2)[:, :context].repeat_interleave(GROUP, 0)

        positions = torch.arange(num_new).unsqueeze(1) + num_cached
        keys = torch.arange(context).unsqueeze(0)
        mask = (keys <= positions) & (keys > positions - (window or context))
        scores = q[starts[i] : starts[i] + num_new].transpose(0, 1) @ flat(k_cache).transpose(1, 2) * HEAD_DIM**-0.5
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        expected = (scores.masked_fill(~mask, float("-inf")).softmax(-1) @ flat(v_cache)).transpose(0, 1)
        torch.testing.assert_close(out[starts[i] : starts[i] + num_new], expected, atol=1e-5, rtol=1e-4)
