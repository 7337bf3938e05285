"""The CPU's grouped LoRA GEMM: for each adapter a step uses, its tokens' shrink (x A^T) and expand
(.. B^T) as two matmuls, added into the base Linear's output; base rows are not touched."""

from __future__ import annotations

import torch

from services.worker.lora.layers import LoraRows


def lora_add(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, rows: LoraRows) -> torch.Tensor:
    """y += B[s] A[s] x per token of slot s. x [T, in], y [T, out], a [S, R', in], b [S, out, R'].
    A decode-sized step takes every slot's tokens at once (two batched matmuls over the slots, the
    tokens padded per slot); a longer one goes slot by slot, each slot's tokens a slice or gathered."""
    if rows.padded is not None:
        num_slots = rows.padded.shape[0]
        xs = torch.cat([x, x.new_zeros(1, x.shape[1])])[rows.padded]  # [S, n, in]; padding reads the zero row
        delta = torch.bmm(torch.bmm(xs, a[:num_slots].transpose(1, 2)), b[:num_slots].transpose(1, 2))
        out = torch.cat([y, y.new_zeros(1, y.shape[1])])  # padding adds into the extra row, dropped after
        return out.index_add_(0, rows.padded.view(-1), delta.view(-1, y.shape[1]))[: y.shape[0]]
    for slot, tokens in rows.groups:
        if isinstance(tokens, slice):
            y[tokens].addmm_(x[tokens] @ a[slot].T, b[slot].T)
        else:
            y.index_add_(0, tokens, (x.index_select(0, tokens) @ a[slot].T) @ b[slot].T)
    return y
