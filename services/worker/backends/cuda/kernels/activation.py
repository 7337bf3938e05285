"""SiLU-and-multiply: [T, 2n] (gate, up side by side) -> silu(gate) * up, [T, n]."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_and_mul(x_ptr, out_ptr, stride_x, stride_o, N, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + N + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)  # rounded as torch's silu rounds, then multiplied
    tl.store(out_ptr + row * stride_o + cols, silu * up, mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    num_rows, width = x.shape
    n = width // 2
    out = torch.empty(num_rows, n, dtype=x.dtype, device=x.device)
    if num_rows:
        block = min(1024, triton.next_power_of_2(n))
        _silu_and_mul[(num_rows, triton.cdiv(n, block))](x, out, x.stride(0), out.stride(0), n, BLOCK=block)
    return out
