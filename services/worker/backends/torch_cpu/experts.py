"""Routed experts on torch: the reference every backend's grouped expert GEMMs are checked against."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def grouped_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                    experts: torch.Tensor) -> torch.Tensor:
    """x [T, H]; w13 [E, 2I, H] (gate rows, then up); w2 [E, H, I]; weights and experts [T, k] ->
    [T, H]: the (token, expert) pairs sorted by expert, each expert's rows in one GEMM, and the
    outputs weighted back onto their tokens."""
    k = experts.shape[1]
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    tokens = order // k
    out = torch.zeros_like(x)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows = tokens[start : start + n]
        gate, up = F.linear(x[rows], w13[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[e]) * weights.reshape(-1)[order[start : start + n], None]
        out.index_add_(0, rows, y)
        start += n
    return out
