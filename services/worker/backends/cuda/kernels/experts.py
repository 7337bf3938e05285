"""Routed experts as grouped GEMMs: each token's top-k (token, expert) pairs sorted by expert into
tiles of BLOCK_M rows that share one expert, and one launch per projection in which every tile
multiplies its rows by its expert's weights.

The sort runs on the device with no host sync (the launch's tile count is the bound
ceil(pairs / BLOCK_M) + experts; tiles past the real ones find no expert and do nothing), so the
step stays free of the round trips the torch path's per-expert loop needs. The gate and up
projections are one GEMM ([E, 2I, H]); SwiGLU runs between; the down projection's rows are
weighted by their routing weights, then each token's k rows summed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.worker.backends.cuda.kernels.activation import silu_and_mul
from services.worker.backends.cuda.kernels.online_softmax import dot

BLOCK_M = 16


@triton.jit
def _expert_gemm(a_ptr, w_ptr, out_ptr, pairs_ptr, tile_expert_ptr, weights_ptr, num_pairs, N, K, num_experts,
                 stride_am, stride_we, stride_wn, stride_om, TOP_K: tl.constexpr, ROWS_ARE_TOKENS: tl.constexpr,
                 WEIGHTED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 IEEE: tl.constexpr):
    """out[pair] = a[row] @ w[expert].T for the tile's pairs (row: the pair's token, or the pair)."""
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile)
    is_real = expert < num_experts  # tiles past the last real one: no rows
    expert = tl.where(is_real, expert, 0)
    pairs = tl.load(pairs_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < tl.where(is_real, num_pairs, 0)  # a tile's tail is padding
    rows = pairs // TOP_K if ROWS_ARE_TOKENS else pairs
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + rows[:, None] * stride_am + k[None, :], mask=valid[:, None] & (k[None, :] < K), other=0.0)
        w = tl.load(w_ptr + expert * stride_we + n[None, :] * stride_wn + k[:, None],
                    mask=(n[None, :] < N) & (k[:, None] < K), other=0.0)  # [BLOCK_K, BLOCK_N]
        acc += dot(a, w, IEEE)
    if WEIGHTED:
        acc = acc * tl.load(weights_ptr + pairs, mask=valid, other=0.0)[:, None]
    tl.store(out_ptr + pairs[:, None] * stride_om + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=valid[:, None] & (n[None, :] < N))


def sort_pairs(experts: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """experts [T, k] -> (pairs: the (token, expert) pair indices t * k + j grouped by expert, each
    group padded with num_pairs to a multiple of BLOCK_M; tile_expert: each tile's expert, or
    num_experts past the last real tile). Device ops only."""
    flat = experts.reshape(-1)
    num_pairs = flat.numel()
    order = torch.argsort(flat, stable=True)
    # bincount reads its input's max on the host; a scatter-add of ones does not (CUDA graphs capture it)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends_padded = torch.cumsum(padded, 0)
    starts = torch.cumsum(counts, 0) - counts
    sorted_experts = flat[order]
    dest = (ends_padded - padded)[sorted_experts] + torch.arange(num_pairs, device=flat.device) - starts[sorted_experts]
    num_tiles = triton.cdiv(num_pairs, BLOCK_M) + num_experts  # a bound: each expert adds at most one partial tile
    pairs = torch.full((num_tiles * BLOCK_M,), num_pairs, dtype=torch.int64, device=flat.device)
    pairs[dest] = order
    tile_starts = torch.arange(num_tiles, device=flat.device) * BLOCK_M
    tile_expert = torch.searchsorted(ends_padded, tile_starts, right=True)  # num_experts past the last
    return pairs, tile_expert


def _gemm(a: torch.Tensor, w: torch.Tensor, pairs: torch.Tensor, tile_expert: torch.Tensor, num_pairs: int,
          top_k: int, rows_are_tokens: bool, weights: torch.Tensor | None) -> torch.Tensor:
    num_experts, n, k = w.shape
    out = torch.empty(num_pairs, n, dtype=a.dtype, device=a.device)
    block_n = 64 if n >= 64 else 32
    grid = (tile_expert.shape[0], triton.cdiv(n, block_n))
    _expert_gemm[grid](a, w, out, pairs, tile_expert, weights if weights is not None else out, num_pairs, n, k,
                       num_experts, a.stride(0), w.stride(0), w.stride(1), out.stride(0), TOP_K=top_k,
                       ROWS_ARE_TOKENS=rows_are_tokens, WEIGHTED=weights is not None, BLOCK_M=BLOCK_M,
                       BLOCK_N=block_n, BLOCK_K=32, IEEE=a.dtype == torch.float32)
    return out


def grouped_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                    experts: torch.Tensor) -> torch.Tensor:
    """x [T, H]; w13 [E, 2I, H] (gate rows, then up); w2 [E, H, I]; weights and experts [T, k] ->
    [T, H]: what services/worker/models/moe.py's torch version computes."""
    num_tokens, top_k = experts.shape
    if num_tokens == 0:
        return torch.zeros_like(x)
    num_pairs = num_tokens * top_k
    pairs, tile_expert = sort_pairs(experts, w13.shape[0])
    gate_up = _gemm(x, w13, pairs, tile_expert, num_pairs, top_k, True, None)  # [pairs, 2I]
    down = _gemm(silu_and_mul(gate_up), w2, pairs, tile_expert, num_pairs, top_k, False,
                 weights.reshape(-1).to(x.dtype).contiguous())  # [pairs, H], each row weighted
    return down.view(num_tokens, top_k, -1).sum(1)
