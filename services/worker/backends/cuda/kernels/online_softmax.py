"""One K/V block of attention's online softmax, shared by the decode and the prefill kernels."""

from __future__ import annotations

import triton
import triton.language as tl

NO_WINDOW = 2**30  # the window a full-attention layer passes: longer than any context


@triton.jit
def dot(a, b, IEEE: tl.constexpr):
    """float32 tiles multiply in IEEE float32 (exact against the torch path), not TF32."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def attend_block(q, k_ptr, v_ptr, offsets, d_mask, visible, scale, k_scale, v_scale, softcap, m, denom, acc,
                 IEEE: tl.constexpr, IS_FP8: tl.constexpr, SOFTCAP: tl.constexpr):
    """q [rows, d] against the block's keys at `offsets` ([block_size, d]); `visible` [rows,
    block_size] masks keys a row may not see (a row may see none of them); SOFTCAP: the scores are
    soft-capped at `softcap` first. Returns the running (max, denominator, accumulator)."""
    k = tl.load(k_ptr + offsets, mask=d_mask, other=0.0)
    v = tl.load(v_ptr + offsets, mask=d_mask, other=0.0)
    if IS_FP8:  # stored divided by the layer's scale
        k = (k.to(tl.float32) * k_scale).to(q.dtype)
        v = (v.to(tl.float32) * v_scale).to(q.dtype)
    scores = dot(q, tl.trans(k), IEEE) * scale
    if SOFTCAP:  # softcap * tanh(scores / softcap), tanh(x) = 1 - 2 / (exp(2x) + 1)
        scores = softcap * (1.0 - 2.0 / (tl.exp(2.0 * scores / softcap) + 1.0))
    scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    # a row that has seen no key yet (before its sliding window) keeps m = -inf: exp(-inf - 0) = 0, not nan
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - m_safe)
    p = tl.exp(scores - m_safe[:, None])
    denom = denom * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, IEEE)
    return m_new, denom, acc
