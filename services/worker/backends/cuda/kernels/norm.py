"""RMSNorm, and RMSNorm fused with the residual add before it (one read of each row, one write of each)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm(x_ptr, residual_ptr, weight_ptr, out_ptr, eps, stride_x, stride_r, stride_o,
              N: tl.constexpr, BLOCK_N: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = x + tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        tl.store(residual_ptr + row * stride_r + cols, x, mask=mask)  # the stream, summed in place
    x32 = x.to(tl.float32)
    normed = x32 * tl.rsqrt(tl.sum(x32 * x32, axis=0) / N + eps)
    weight = tl.load(weight_ptr + cols, mask=mask)
    tl.store(out_ptr + row * stride_o + cols, weight * normed.to(x.dtype), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """x: [T, n]. With `residual`, it becomes x + residual (in place) and the norm is of that sum."""
    out = torch.empty_like(x)
    if x.shape[0]:
        n = x.shape[-1]
        _rms_norm[(x.shape[0],)](x, residual if residual is not None else x, weight, out, eps, x.stride(0),
                                 residual.stride(0) if residual is not None else 0, out.stride(0),
                                 N=n, BLOCK_N=triton.next_power_of_2(n), HAS_RESIDUAL=residual is not None)
    return out
