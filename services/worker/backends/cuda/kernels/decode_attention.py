"""Paged attention for decode rows (one query token each), split-KV.

One program per (row, KV head, split): the GROUP query heads that share the KV head are packed
into one tile (so each K/V block is read once for all of them, and tl.dot gets >= 16 rows), and
the split walks its share of the row's blocks with an online softmax. A second kernel merges the
splits' partial results by their log-sum-exp. Long contexts get more splits, so a small batch
still fills the GPU; short ones take one. A sliding-window layer's splits start at the block
holding the window's first key and mask the keys before it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.worker.backends.cuda.kernels.online_softmax import NO_WINDOW, attend_block


@triton.jit
def _decode_split(q_ptr, k_ptr, v_ptr, rows_ptr, tables_ptr, lens_ptr, acc_ptr, ml_ptr, scale, k_scale, v_scale,
                  window, softcap, stride_qt, stride_qh, stride_tb, stride_cb, stride_ch, stride_ct, blocks_per_split,
                  GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr, IEEE: tl.constexpr, IS_FP8: tl.constexpr,
                  SOFTCAP: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_heads = tl.num_programs(1) * GROUP
    row = tl.load(rows_ptr + seq)
    context = tl.load(lens_ptr + seq)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    t = tl.arange(0, BLOCK_SIZE)
    heads = kv_head * GROUP + g
    q_mask = (g[:, None] < GROUP) & (d[None, :] < HEAD_DIM)
    q = tl.load(q_ptr + row * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    lo = tl.maximum(context - window, 0)  # the first key in the window
    first = tl.maximum(split * blocks_per_split, lo // BLOCK_SIZE)
    last = tl.minimum(split * blocks_per_split + blocks_per_split, tl.cdiv(context, BLOCK_SIZE))
    for i in range(first, last):
        block = tl.load(tables_ptr + seq * stride_tb + i).to(tl.int64)
        offsets = block * stride_cb + kv_head * stride_ch + t[:, None] * stride_ct + d[None, :]
        keys = (i * BLOCK_SIZE + t)[None, :]
        visible = (keys < context) & (keys >= lo)
        m, denom, acc = attend_block(q, k_ptr, v_ptr, offsets, d[None, :] < HEAD_DIM, visible, scale, k_scale, v_scale,
                                     softcap, m, denom, acc, IEEE, IS_FP8, SOFTCAP)
    # partial results, unnormalized: acc [seq, head, split, d], (m, denom) [seq, head, split, 2]
    base = (seq * num_heads + heads) * NUM_SPLITS + split
    tl.store(acc_ptr + base[:, None] * BLOCK_D + d[None, :], acc, mask=g[:, None] < GROUP)
    tl.store(ml_ptr + base * 2, m, mask=g < GROUP)
    tl.store(ml_ptr + base * 2 + 1, denom, mask=g < GROUP)


@triton.jit
def _merge_splits(acc_ptr, ml_ptr, rows_ptr, out_ptr, stride_ot, stride_oh,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    num_heads = tl.num_programs(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    base = (seq * num_heads + head) * NUM_SPLITS + s
    m = tl.load(ml_ptr + base * 2, mask=s < NUM_SPLITS, other=float("-inf"))
    denom = tl.load(ml_ptr + base * 2 + 1, mask=s < NUM_SPLITS, other=0.0)
    acc = tl.load(acc_ptr + base[:, None] * BLOCK_D + d[None, :], mask=s[:, None] < NUM_SPLITS, other=0.0)
    weight = tl.where(m > float("-inf"), tl.exp(m - tl.max(m, axis=0)), 0.0)  # an empty split weighs nothing
    out = tl.sum(acc * weight[:, None], axis=0) / tl.sum(denom * weight, axis=0)
    row = tl.load(rows_ptr + seq)
    tl.store(out_ptr + row * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def num_splits_for(max_context: int, block_size: int, num_seqs: int, num_kv_heads: int, num_sms: int = 132) -> int:
    """Enough splits to give every SM work, each at least 4 blocks long."""
    max_blocks = triton.cdiv(max_context, block_size)
    wanted = triton.cdiv(num_sms, max(num_seqs * num_kv_heads, 1))
    return max(1, min(wanted, triton.cdiv(max_blocks, 4), 16))


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                     rows: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                     num_splits: int, k_scale: float = 1.0, v_scale: float = 1.0, window: int | None = None,
                     softcap: float | None = None) -> None:
    """q, out: [T, heads, d] (rows `rows` of them are decode rows); block_tables: [B, max_blocks];
    context_lens: [B]; window, softcap: a sliding-window or soft-capped layer's. Writes out[rows]."""
    num_seqs = rows.shape[0]
    if num_seqs == 0:
        return
    _, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    block_d = triton.next_power_of_2(head_dim)
    blocks_per_split = triton.cdiv(block_tables.shape[1], num_splits)
    acc = torch.empty(num_seqs, num_heads, num_splits, block_d, dtype=torch.float32, device=q.device)
    ml = torch.empty(num_seqs, num_heads, num_splits, 2, dtype=torch.float32, device=q.device)
    _decode_split[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, rows, block_tables, context_lens, acc, ml, scale, k_scale, v_scale,
        NO_WINDOW if window is None else window, softcap or 1.0,
        q.stride(0), q.stride(1), block_tables.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        blocks_per_split, GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_D=block_d, BLOCK_SIZE=block_size, NUM_SPLITS=num_splits, IEEE=q.dtype == torch.float32,
        IS_FP8=k_cache.dtype == torch.float8_e4m3fn, SOFTCAP=softcap is not None)
    _merge_splits[(num_seqs, num_heads)](acc, ml, rows, out, out.stride(0), out.stride(1), HEAD_DIM=head_dim,
                                         BLOCK_D=block_d, NUM_SPLITS=num_splits,
                                         BLOCK_S=triton.next_power_of_2(num_splits))
