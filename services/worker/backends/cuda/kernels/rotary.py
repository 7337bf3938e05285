"""Rotary embedding on q and k in place (half-split layout), from the step's cos/sin rows; a
partial rotary (cos narrower than a head: Phi-4-mini's) rotates the head's first values alone."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(x_ptr, cos_ptr, sin_ptr, stride_t, stride_h, stride_c, num_heads,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    token = tl.program_id(0)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < num_heads) & (d < HALF)
    cos = tl.load(cos_ptr + token * stride_c + d, mask=d < HALF, other=0.0)
    sin = tl.load(sin_ptr + token * stride_c + d, mask=d < HALF, other=0.0)
    first = x_ptr + token * stride_t + h * stride_h + d
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(first + HALF, mask=mask, other=0.0)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(first, (a * cos - b * sin).to(x1.dtype), mask=mask)
    tl.store(first + HALF, (b * cos + a * sin).to(x1.dtype), mask=mask)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, heads, d], k: [T, kv_heads, d] (rotated in place); cos/sin: [T, r] float32 (both halves
    equal), r <= d: the first r values of each head rotate, the rest pass as they are."""
    num_tokens = q.shape[0]
    half = cos.shape[-1] // 2
    if num_tokens:
        for x in (q, k):
            _rotate_heads[(num_tokens,)](x, cos, sin, x.stride(0), x.stride(1), cos.stride(0), x.shape[1],
                                         HALF=half, BLOCK_H=triton.next_power_of_2(x.shape[1]),
                                         BLOCK_HALF=triton.next_power_of_2(half))
    return q, k
