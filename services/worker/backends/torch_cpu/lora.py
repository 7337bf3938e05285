"""The CPU's grouped LoRA GEMM: for each adapter a step uses, its tokens' shrink (x A^T) and expand
(.. B^T) as two matmuls, added into the base Linear's output; base rows are not touched."""

from __future__ import annotations

import torch

from services.worker.lora.layers import LoraRows


def lora_add(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, rows: LoraRows) -> torch.Tensor:
    """y += B[s] A[s] x per token of slot s. x [T, in], y [T, out], a [S, R', in], b [S, out, R']."""
    for slot, tokens in rows.groups:
        if isinstance(tokens, slice):
            y[tokens].addmm_(x[tokens] @ a[slot].T, b[slot].T)
        else:
            y.index_add_(0, tokens, (x.index_select(0, tokens) @ a[slot].T) @ b[slot].T)
    return y
