"""Mixtral and Qwen3-MoE: Llama's (or Qwen3's) attention, and a sparse mixture of SwiGLU experts
in place of the MLP, each token routed to its top-k experts by a softmax over a linear router."""

from __future__ import annotations

import torch
from torch import nn

from services.worker.backends.base import LayerOps
from services.worker.model_config import ModelConfig
from services.worker.models.llama import Llama, TransformerBlock
from services.worker.models.qwen3 import Qwen3Attention


class SparseMoE(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: LayerOps):
        super().__init__()
        e, i, h = cfg.num_experts, cfg.moe_intermediate_size or cfg.intermediate_size, cfg.hidden_size
        self.ops = ops
        self.top_k, self.normalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = nn.Linear(h, e, bias=False)  # the router
        self.w1 = nn.Parameter(torch.empty(e, i, h))  # each expert's gate projection
        self.w3 = nn.Parameter(torch.empty(e, i, h))  # up
        self.w2 = nn.Parameter(torch.empty(e, h, i))  # down

    def fuse(self) -> None:
        """w1 and w3 -> one w13 per expert (one GEMM for both)."""
        self.w13 = nn.Parameter(torch.cat([self.w1, self.w3], dim=1), requires_grad=False)
        del self.w1, self.w3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return self.ops.routed_experts(x, self.w13, self.w2, weights.to(x.dtype), experts)


class MixtralBlock(TransformerBlock):
    feed_forward_class = SparseMoE


class Mixtral(Llama):
    block_class = MixtralBlock


class Qwen3MoeBlock(TransformerBlock):
    attention_class = Qwen3Attention
    feed_forward_class = SparseMoE


class Qwen3Moe(Llama):
    block_class = Qwen3MoeBlock
