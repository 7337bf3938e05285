"""Paged attention for prefill chunks over a ragged batch: each chunk's queries sit after its
cached prefix (a prefix-cache hit or an earlier chunk) and see that prefix and, causally, the
chunk itself; K/V are read through the chunk's block table, one block at a time.

One program per (chunk, tile of BLOCK_M queries, query head); tiles past a chunk's end do nothing.
In a sliding-window layer a tile starts at the block holding its first query's first key. With
`limits` (Gemma 3's images), a query also sees the later keys of its image, up to its row's limit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.worker.backends.cuda.kernels.online_softmax import NO_WINDOW, attend_block


@triton.jit
def _prefill(q_ptr, k_ptr, v_ptr, out_ptr, starts_ptr, lens_ptr, cached_ptr, tables_ptr, limits_ptr, scale, k_scale,
             v_scale, window, softcap, stride_qt, stride_qh, stride_ot, stride_oh, stride_tb, stride_cb, stride_ch,
             stride_ct, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
             BLOCK_SIZE: tl.constexpr, IEEE: tl.constexpr, IS_FP8: tl.constexpr,
             SOFTCAP: tl.constexpr, SPANS: tl.constexpr):
    chunk = tl.program_id(0)
    tile = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // GROUP
    num_query = tl.load(lens_ptr + chunk)
    start = tl.load(starts_ptr + chunk)
    num_cached = tl.load(cached_ptr + chunk)
    m_idx = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    t = tl.arange(0, BLOCK_SIZE)
    row_mask = m_idx < num_query
    q = tl.load(q_ptr + (start + m_idx)[:, None] * stride_qt + head * stride_qh + d[None, :],
                mask=row_mask[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
    positions = num_cached + m_idx
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    last = num_cached + tl.minimum(num_query, (tile + 1) * BLOCK_M)  # keys past the tile's last query: none
    limit = positions  # the last key each query sees: causally itself
    if SPANS:  # an image's tokens see its later ones too (their limits stay inside the chunk)
        limit = tl.maximum(limit, tl.load(limits_ptr + start + m_idx, mask=row_mask, other=0))
        last = tl.maximum(last, tl.max(tl.where(row_mask, limit, 0), axis=0) + 1)
    num_blocks = tl.where(tile * BLOCK_M < num_query, tl.cdiv(last, BLOCK_SIZE), 0)
    first = tl.maximum(num_cached + tile * BLOCK_M - window + 1, 0) // BLOCK_SIZE
    for i in range(first, num_blocks):
        block = tl.load(tables_ptr + chunk * stride_tb + i).to(tl.int64)
        offsets = block * stride_cb + kv_head * stride_ch + t[:, None] * stride_ct + d[None, :]
        keys = (i * BLOCK_SIZE + t)[None, :]
        visible = (keys <= limit[:, None]) & (keys > positions[:, None] - window)
        m, denom, acc = attend_block(q, k_ptr, v_ptr, offsets, d[None, :] < HEAD_DIM, visible, scale, k_scale, v_scale,
                                     softcap, m, denom, acc, IEEE, IS_FP8, SOFTCAP)
    out = acc / denom[:, None]
    tl.store(out_ptr + (start + m_idx)[:, None] * stride_ot + head * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & (d[None, :] < HEAD_DIM))


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                      starts: torch.Tensor, lens: torch.Tensor, num_cached: torch.Tensor, block_tables: torch.Tensor,
                      max_query_len: int, scale: float, k_scale: float = 1.0, v_scale: float = 1.0,
                      window: int | None = None, softcap: float | None = None,
                      limits: torch.Tensor | None = None) -> None:
    """q, out: [T, heads, d]; per chunk: first row `starts`, `lens` queries, `num_cached` tokens before
    them, block table row; limits: [T] int32, the last key position each row also sees (-1: none
    past itself). Writes the chunks' rows of out."""
    num_chunks = starts.shape[0]
    if num_chunks == 0:
        return
    _, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[1], k_cache.shape[2]
    block_m = 16 if max_query_len <= 16 else 64
    _prefill[(num_chunks, triton.cdiv(max_query_len, block_m), num_heads)](
        q, k_cache, v_cache, out, starts, lens, num_cached, block_tables, starts if limits is None else limits,
        scale, k_scale, v_scale,
        NO_WINDOW if window is None else window, softcap or 1.0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_M=block_m, BLOCK_SIZE=block_size, IEEE=q.dtype == torch.float32,
        IS_FP8=k_cache.dtype == torch.float8_e4m3fn, SOFTCAP=softcap is not None, SPANS=limits is not None)
