"""Qwen3: Llama's layers with an RMSNorm over each head of q and k before the rotary (no q/k/v biases)."""

from __future__ import annotations

import torch
from torch import nn

from services.worker.backends.base import LayerOps
from services.worker.model_config import ModelConfig
from services.worker.models.llama import Attention, Llama, TransformerBlock


class HeadNorm(nn.Module):
    """RMSNorm over the last dimension (a head's d values), computed in float32 as transformers does."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Qwen3Attention(Attention):
    def __init__(self, cfg: ModelConfig, ops: LayerOps, layer: int):
        super().__init__(cfg, ops, layer)
        self.q_norm = HeadNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = HeadNorm(cfg.head_dim, cfg.rms_norm_eps)

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = super().qkv(x)
        return self.q_norm(q), self.k_norm(k), v


class Qwen3Block(TransformerBlock):
    attention_class = Qwen3Attention


class Qwen3(Llama):
    block_class = Qwen3Block
