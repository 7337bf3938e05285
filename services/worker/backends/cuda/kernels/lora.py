"""The grouped LoRA GEMM for a mixed batch (punica's BGMV): each token's row times its own adapter
slot's matrix, in one launch for all adapters; a shrink (x A^T) into float32, then an expand
(.. B^T) added into the base Linear's output. Tokens on the base model (slot -1) are skipped."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.worker.lora.layers import LoraRows


@triton.jit
def _bgmv(x_ptr, w_ptr, out_ptr, slots_ptr, N, K, stride_x, stride_ws, stride_wn, stride_o,
          ADD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[t, n] (+)= sum_k x[t, k] * w[slot[t], n, k] for one token t and BLOCK_N outputs."""
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t)
    if slot >= 0:
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros([BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + t * stride_x + k, mask=k < K, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + slot * stride_ws + n[:, None] * stride_wn + k[None, :],
                        mask=(n[:, None] < N) & (k[None, :] < K), other=0.0).to(tl.float32)
            acc += tl.sum(w * x[None, :], axis=1)
        out = out_ptr + t * stride_o + n
        if ADD:
            acc += tl.load(out, mask=n < N, other=0.0).to(tl.float32)
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=n < N)


def _launch(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, slots: torch.Tensor, add: bool) -> None:
    num_tokens, k = x.shape
    n = w.shape[1]
    block_n = min(64, triton.next_power_of_2(n))
    block_k = min(64, triton.next_power_of_2(k))
    _bgmv[(num_tokens, triton.cdiv(n, block_n))](x, w, out, slots, n, k, x.stride(0), w.stride(0), w.stride(1),
                                                 out.stride(0), ADD=add, BLOCK_N=block_n, BLOCK_K=block_k)


def lora_add(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, rows: LoraRows) -> torch.Tensor:
    """y += B[s] A[s] x per token of slot s (rows.token_slots), in place. x [T, in], y [T, out] contiguous."""
    if not x.shape[0]:
        return y
    x = x.contiguous()
    shrunk = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float32, device=x.device)
    _launch(x, a, shrunk, rows.token_slots, add=False)
    _launch(shrunk, b, y, rows.token_slots, add=True)
    return y
