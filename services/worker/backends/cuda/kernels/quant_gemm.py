"""The GEMM over a quantized checkpoint's weights (AWQ, GPTQ, compressed-tensors int4/int8): each
tile of weights decoded from the file's integers, w = q * scale + low per group of inputs, into the
activations' dtype, then one tl.dot; the weights stay in about the file's bytes on the GPU."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.worker.backends.cuda.kernels.online_softmax import dot


@triton.jit
def _quant_gemm(x_ptr, q_ptr, s_ptr, l_ptr, out_ptr, M, N, K, stride_x, stride_q, stride_s, stride_o,
                BITS: tl.constexpr, GROUP: tl.constexpr, HAS_LOW: tl.constexpr, IEEE: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[m, n] = sum_k x[m, k] * (q[n, k] * s[n, k / GROUP] + l[n, k / GROUP]). 4 bits: q packed two
    inputs a byte (input 2j in byte j's low nibble, 2j + 1 in its high one); 8 bits: int8."""
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + m[:, None] * stride_x + k[None, :], mask=(m[:, None] < M) & (k[None, :] < K), other=0.0)
        wmask = (n[:, None] < N) & (k[None, :] < K)
        if BITS == 4:
            byte = tl.load(q_ptr + n[:, None] * stride_q + k[None, :] // 2, mask=wmask, other=0)
            q = ((byte.to(tl.int32) >> ((k[None, :] % 2) * 4)) & 0xF).to(tl.float32)
        else:
            q = tl.load(q_ptr + n[:, None] * stride_q + k[None, :], mask=wmask, other=0).to(tl.float32)
        group = n[:, None] * stride_s + k[None, :] // GROUP
        w = q * tl.load(s_ptr + group, mask=wmask, other=0.0)
        if HAS_LOW:
            w += tl.load(l_ptr + group, mask=wmask, other=0.0)
        acc += dot(x, tl.trans(w.to(x.dtype)), IEEE)
    tl.store(out_ptr + m[:, None] * stride_o + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(m[:, None] < M) & (n[None, :] < N))


def quant_gemm(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, lows: torch.Tensor | None, bits: int,
               group: int) -> torch.Tensor:
    """x [..., K] times the weight q [N, K / 2] (4 bits) or [N, K] (8 bits) with float32 scales and lows
    [N, K / group] transposed -> [..., N] in x's dtype."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    m, k = rows.shape
    n = q.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m = max(16, min(64, triton.next_power_of_2(m)))
    block_n, block_k = 64, min(64, group)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _quant_gemm[grid](rows, q, scales, scales if lows is None else lows, out, m, n, k, rows.stride(0), q.stride(0),
                      scales.stride(0), out.stride(0), BITS=bits, GROUP=group, HAS_LOW=lows is not None,
                      IEEE=x.dtype == torch.float32, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return out.reshape(*x.shape[:-1], n)
