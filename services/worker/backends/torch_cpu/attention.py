"""Paged attention on torch: K/V written through the slot mapping, read through block tables.

The torch backend is the reference every faster backend is tested against. The pool keeps each
block head-major, `[num_blocks, num_kv_heads, block_size, head_dim]`, so the blocks gathered for
a sequence feed batched matmuls as they are, with no transposed copy. Decode rows (one query
token each) are batched into grouped matmuls with a length mask, or (`native`) go to the C
kernels' decode_attention, which reads each sequence's blocks in place. With `native`, a prefill
chunk's rows go to prefill_attention, each computed as its token's decode would be: a row's result
is the same bits whether its prompt hit the prefix cache, was chunked or shared the step. Otherwise
a prefill chunk with nothing cached before it runs causal SDPA; one after a cached prefix (a
prefix-cache hit, or a later chunk of a chunked prefill) runs grouped matmuls with the causal mask
shifted by the prefix.
A sliding-window layer (`window`: each query sees itself and the window - 1 keys before it, as
transformers masks) masks the keys before the window; a soft-capped one (`softcap`: scores ->
cap * tanh(scores / cap), Gemma 2) computes its scores as plain matmuls; the C kernels take both.
In a prefill, an image's tokens (Gemma 3's) also see its later tokens (the reference's paths).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

HEAD_DIMS = (64, 96, 128, 256)  # the head sizes the C kernels are built for
NATIVE_DTYPES = (torch.float32, torch.bfloat16)  # what the C kernels take
# a prefill chunk after a cached prefix of at most this many queries (a speculative verification, a
# small chunk) runs as plain matmuls while its float32 scores (heads x queries x context) stay this
# small (64 MiB); any other, as SDPA's flash kernel over the prefix and over the chunk, merged
MATMUL_ATTENTION_MAX_QUERIES = 16
MATMUL_ATTENTION_MAX_SCORES = 16 * 2**20


@dataclass
class AttentionMetadata:
    """Everything attention needs about the ragged batch; built once per step, passed to layers."""

    slot_mapping: torch.Tensor  # [num_tokens] flat cache slot for each new token
    # decode rows: one query token each, batched
    decode_token_idx: torch.Tensor  # [num_decode] rows in the flattened batch, in order (no prefills: every row)
    decode_block_tables: torch.Tensor  # [num_decode, max_blocks], padded with the null block
    decode_context_mask: torch.Tensor  # [num_decode, 1, 1, max_blocks * block_size]
    decode_context_lens: torch.Tensor  # [num_decode] int64, the new token included
    # prefill chunks: (first row, num query tokens, num cached tokens before them, block ids)
    prefills: list[tuple[int, int, int, torch.Tensor]]
    # the longest decode context, known on the host: a sliding window no decode row outgrows
    # changes nothing, so the reference's matmuls skip its mask (unknown: every window is applied)
    decode_max_context: int = 2**62
    # image tokens that see each other both ways (Gemma 3): a prefill's first row -> its images'
    # [start, end) positions, each wholly inside the prefill's context
    bidirectional: dict[int, list[tuple[int, int]]] = field(default_factory=dict)

    @property
    def num_decodes(self) -> int:
        return int(self.decode_token_idx.numel())


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k_cache: [num_blocks, num_kv_heads, block_size, head_dim]; k: [num_tokens, num_kv_heads, head_dim]."""
    block_size = k_cache.shape[2]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    k_cache[blocks, :, offsets] = k.to(k_cache.dtype)
    v_cache[blocks, :, offsets] = v.to(v_cache.dtype)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, native: bool = False, window: int | None = None,
                    softcap: float | None = None) -> torch.Tensor:
    """q: [num_tokens, num_heads, head_dim] -> [num_tokens, num_heads, head_dim]. `native`: the decode
    rows run the C kernels' decode_attention, the prefill rows prefill_attention, where they take the
    head size and dtype (and, for a prefill, no image's two-way span)."""
    if not meta.prefills:  # every row decodes, in order: no gather, no scatter
        return _decode_rows(q, k_cache, v_cache, meta, scale, native, window, softcap)
    out = torch.empty_like(q)
    if meta.num_decodes:
        out[meta.decode_token_idx] = _decode_rows(q[meta.decode_token_idx], k_cache, v_cache, meta, scale, native,
                                                  window, softcap)
    for start, num_query, num_cached, block_ids in meta.prefills:
        rows = q[start : start + num_query]
        if _kernel_takes(native, rows, k_cache) and not meta.bidirectional.get(start):
            out[start : start + num_query] = torch.ops.switchyard_cpu.prefill_attention(
                rows, k_cache, v_cache, block_ids, num_cached, scale, window or 0, softcap or 0.0)
        else:
            out[start : start + num_query] = _prefill(rows, k_cache, v_cache, num_cached, block_ids, scale, window,
                                                      softcap, meta.bidirectional.get(start, ()))
    return out


def _kernel_takes(native: bool, q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """The C kernels' attention takes these rows: their head size and dtype."""
    return native and q.shape[-1] in HEAD_DIMS and q.dtype in NATIVE_DTYPES and q.dtype == k_cache.dtype


def _decode_rows(q, k_cache, v_cache, meta: AttentionMetadata, scale: float, native: bool, window: int | None,
                 softcap: float | None) -> torch.Tensor:
    """The decode rows' queries [num_decodes, heads, d] -> their outputs: the C kernel, or the matmuls."""
    if _kernel_takes(native, q, k_cache):
        return torch.ops.switchyard_cpu.decode_attention(q, k_cache, v_cache, meta.decode_block_tables,
                                                         meta.decode_context_lens, scale, window or 0, softcap or 0.0)
    if window is not None and not torch.compiler.is_dynamo_compiling() and meta.decode_max_context <= window:
        window = None  # every decode row sees its whole context (a compiled graph keeps the mask)
    return _decode(q, k_cache, v_cache, meta, scale, window, softcap)


def _gather(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[B, nb] block ids -> [B, nb, h, bs, d] (one flat index_select: cheaper than 2-D indexing)."""
    blocks = cache.index_select(0, block_tables.flatten())
    return blocks.view(*block_tables.shape, *cache.shape[1:])


def _decode(q, k_cache, v_cache, meta: AttentionMetadata, scale: float, window: int | None = None,
            softcap: float | None = None) -> torch.Tensor:
    """One query token per sequence: grouped batched matmuls over the gathered blocks, softmax in
    float32. (SDPA's CPU kernel is built for long queries; for a single one it costs ~10x these.)"""
    num_seqs, num_heads, head_dim = q.shape
    k = _gather(k_cache, meta.decode_block_tables)  # [B, nb, h_kv, bs, d]
    v = _gather(v_cache, meta.decode_block_tables)
    _, num_blocks, num_kv_heads, block_size, _ = k.shape
    group = num_heads // num_kv_heads
    # query heads grouped by the KV head they share, the same query for every block
    qg = q.to(k.dtype).view(num_seqs, 1, num_kv_heads, group, head_dim).expand(-1, num_blocks, -1, -1, -1)
    scores = torch.matmul(qg, k.transpose(-1, -2)).float() * scale  # [B, nb, h_kv, group, bs]
    scores = scores.permute(0, 2, 3, 1, 4).reshape(num_seqs, num_kv_heads, group, num_blocks * block_size)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    visible = meta.decode_context_mask
    if window is not None:  # and not before the window: positions >= context_len - window
        keys = torch.arange(visible.shape[-1], device=q.device)
        visible = visible & (keys >= (meta.decode_context_lens - window).unsqueeze(1)).view(visible.shape)
    scores.masked_fill_(~visible, float("-inf"))
    probs = scores.softmax(-1).to(v.dtype).view(num_seqs, num_kv_heads, group, num_blocks, block_size)
    out = torch.matmul(probs.permute(0, 3, 1, 2, 4), v).sum(1)  # [B, h_kv, group, d]
    return out.reshape(num_seqs, num_heads, head_dim).to(q.dtype)


def _prefill(q, k_cache, v_cache, num_cached: int, block_ids: torch.Tensor, scale: float,
             window: int | None = None, softcap: float | None = None, spans=()) -> torch.Tensor:
    """spans: [start, end) positions whose queries also see the span's later keys (an image's tokens)."""
    num_query, num_heads, _ = q.shape
    context_len = num_cached + num_query
    # the first key any query sees: past a sliding window, the first query's window start
    first = 0 if window is None else max(0, num_cached + 1 - window)

    def contiguous_kv(cache: torch.Tensor) -> torch.Tensor:  # [1, h_kv, ctx - first, d]
        blocks = cache.index_select(0, block_ids)  # [nb, h, bs, d]
        return blocks.transpose(0, 1).flatten(1, 2)[:, first:context_len].to(q.dtype).unsqueeze(0)

    k, v = contiguous_kv(k_cache), contiguous_kv(v_cache)
    qb = q.transpose(0, 1).unsqueeze(0)  # [1, h, nq, d]
    if spans or softcap is not None or (window is not None and context_len > window):
        rows = torch.arange(num_query, device=q.device).unsqueeze(1) + num_cached
        keys = torch.arange(first, context_len, device=q.device).unsqueeze(0)
        mask = keys <= rows
        for begin, end in spans:  # transformers: (causal or both in one image), then the window
            mask |= (rows >= begin) & (rows < end) & (keys >= begin) & (keys < end)
        if window is not None:  # a query i sees keys (i - window, i]
            mask &= keys > rows - window
        if softcap is not None:
            return _capped_attention(qb, k, v, mask, scale, softcap)
        o = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        return o.squeeze(0).transpose(0, 1)
    if num_cached == 0:
        o = F.scaled_dot_product_attention(qb, k, v, is_causal=True, scale=scale, enable_gqa=True)
        return o.squeeze(0).transpose(0, 1)
    if num_query <= MATMUL_ATTENTION_MAX_QUERIES and num_heads * num_query * context_len <= MATMUL_ATTENTION_MAX_SCORES:
        return _matmul_attention(qb, k, v, num_cached, scale)
    return _prefix_then_chunk(qb, k, v, num_cached, scale)


def _capped_attention(qb, k, v, mask: torch.Tensor, scale: float, softcap: float) -> torch.Tensor:
    """Soft-capped scores (SDPA has no cap) as grouped matmuls, masked by `mask` [nq, ctx], softmax in float32."""
    _, num_heads, num_query, head_dim = qb.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    qg = qb.reshape(1, num_kv_heads, group * num_query, head_dim)
    scores = torch.matmul(qg, k.transpose(-1, -2)).float() * scale
    scores = (torch.tanh(scores / softcap) * softcap).view(1, num_kv_heads, group, num_query, -1)
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1).to(v.dtype).view(1, num_kv_heads, group * num_query, -1)
    return torch.matmul(probs, v).view(num_heads, num_query, head_dim).transpose(0, 1)


def _prefix_then_chunk(qb, k, v, num_cached: int, scale: float) -> torch.Tensor:
    """A chunk after a cached prefix: every query sees the whole prefix and the chunk's keys up to
    its own, so SDPA's CPU flash kernel runs twice, unmasked over the prefix and causal over the
    chunk, and the two are merged by their log-sum-exps: no scores are materialized, as SDPA with a
    mask and the matmuls do (`python -m bench.prefix_attention`)."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu  # SDPA's, with the log-sum-exp
    o_prefix, lse_prefix = flash(qb, k[:, :, :num_cached], v[:, :, :num_cached], 0.0, False, scale=scale)
    o_chunk, lse_chunk = flash(qb, k[:, :, num_cached:], v[:, :, num_cached:], 0.0, True, scale=scale)
    top = torch.maximum(lse_prefix, lse_chunk)
    w_prefix, w_chunk = torch.exp(lse_prefix - top).unsqueeze(-1), torch.exp(lse_chunk - top).unsqueeze(-1)
    o = (o_prefix.float() * w_prefix + o_chunk.float() * w_chunk) / (w_prefix + w_chunk)  # [1, h, nq, d]
    return o.to(qb.dtype).squeeze(0).transpose(0, 1)


def _matmul_attention(qb, k, v, num_cached: int, scale: float) -> torch.Tensor:
    """A few queries after a cached prefix, as two grouped matmuls (softmax in float32): up to 16
    queries, a little faster than _prefix_then_chunk's two kernel calls. Every query sees the whole
    prefix, so only the chunk's own keys are masked (causally)."""
    _, num_heads, num_query, head_dim = qb.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    qg = qb.reshape(1, num_kv_heads, group * num_query, head_dim)  # query heads by their KV head
    scores = torch.matmul(qg, k.transpose(-1, -2)).float() * scale  # [1, h_kv, group * nq, ctx]
    scores = scores.view(1, num_kv_heads, group, num_query, -1)
    future = torch.ones(num_query, num_query, dtype=torch.bool, device=qb.device).triu_(1)  # query i, chunk key j > i
    scores[..., num_cached:].masked_fill_(future, float("-inf"))
    probs = scores.softmax(-1).to(v.dtype).view(1, num_kv_heads, group * num_query, -1)
    out = torch.matmul(probs, v).view(num_heads, num_query, head_dim)
    return out.transpose(0, 1)
