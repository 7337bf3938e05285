"""Paged attention on torch: K/V written through the slot mapping, read through block tables.

The torch backend is the reference every faster backend is tested against: it gathers each
sequence's blocks and runs SDPA. Decode rows (one query token) are batched into one SDPA call;
prefill chunks run one SDPA call per sequence with the causal mask shifted by the cached prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Everything attention needs about the ragged batch; built once per step, passed to layers."""

    slot_mapping: torch.Tensor  # [num_tokens] flat cache slot for each new token
    # decode rows: one query token each, batched
    decode_token_idx: torch.Tensor  # [num_decode] row in the flattened batch
    decode_block_tables: torch.Tensor  # [num_decode, max_blocks], padded with block 0
    decode_context_mask: torch.Tensor  # [num_decode, 1, 1, max_blocks * block_size]
    # prefill chunks: (first row, num query tokens, num cached tokens before them, block ids)
    prefills: list[tuple[int, int, int, torch.Tensor]]

    @property
    def num_decodes(self) -> int:
        return int(self.decode_token_idx.numel())


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k_cache: [num_blocks, block_size, num_kv_heads, head_dim]; k: [num_tokens, num_kv_heads, head_dim]."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [num_tokens, num_heads, head_dim] -> [num_tokens, num_heads, head_dim]."""
    out = torch.empty_like(q)
    if meta.num_decodes:
        out[meta.decode_token_idx] = _decode(q[meta.decode_token_idx], k_cache, v_cache, meta, scale)
    for start, num_query, num_cached, block_ids in meta.prefills:
        out[start : start + num_query] = _prefill(
            q[start : start + num_query], k_cache, v_cache, num_cached, block_ids, scale
        )
    return out


def _gather(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """[..., num_blocks] ids -> [..., num_kv_heads, num_blocks * block_size, head_dim]."""
    blocks = cache[block_ids]  # [..., nb, bs, h, d]
    flat = blocks.flatten(-4, -3)  # [..., nb*bs, h, d]
    return flat.transpose(-3, -2)


def _decode(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    k = _gather(k_cache, meta.decode_block_tables).to(q.dtype)  # [B, h_kv, L, d]
    v = _gather(v_cache, meta.decode_block_tables).to(q.dtype)
    qb = q.unsqueeze(2)  # [B, h, 1, d]
    o = F.scaled_dot_product_attention(qb, k, v, attn_mask=meta.decode_context_mask, scale=scale,
                                       enable_gqa=True)
    return o.squeeze(2)


def _prefill(q, k_cache, v_cache, num_cached: int, block_ids: torch.Tensor, scale: float) -> torch.Tensor:
    num_query = q.shape[0]
    context_len = num_cached + num_query
    k = _gather(k_cache, block_ids)[:, :context_len].to(q.dtype).unsqueeze(0)  # [1, h_kv, ctx, d]
    v = _gather(v_cache, block_ids)[:, :context_len].to(q.dtype).unsqueeze(0)
    qb = q.transpose(0, 1).unsqueeze(0)  # [1, h, nq, d]
    if num_cached == 0:
        o = F.scaled_dot_product_attention(qb, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        # query i sits at position num_cached + i and sees keys 0..num_cached + i
        rows = torch.arange(num_query).unsqueeze(1) + num_cached
        mask = torch.arange(context_len).unsqueeze(0) <= rows
        o = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return o.squeeze(0).transpose(0, 1)
