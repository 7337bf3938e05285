"""Llama (and the families that share its shape: Mistral, Qwen2) as the paper writes it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.attention import AttentionMetadata, paged_attention, write_kv
from services.worker.model_config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Rotary(nn.Module):
    """Rotary position embedding in the Hugging Face (half-split) layout."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float().unsqueeze(-1) * self.inv_freq  # [T, d/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, d]; cos/sin: [T, d]."""
        x1, x2 = x.chunk(2, dim=-1)
        rotated = torch.cat([-x2, x1], dim=-1)
        return (x.float() * cos.unsqueeze(1) + rotated.float() * sin.unsqueeze(1)).to(x.dtype)


def fuse_linears(linears: list[nn.Linear]) -> nn.Linear:
    """Linears over the same input, stacked into one whose output is their outputs side by side."""
    first = linears[0]
    fused = nn.Linear(first.in_features, sum(m.out_features for m in linears), bias=first.bias is not None)
    fused.weight = nn.Parameter(torch.cat([m.weight for m in linears]), requires_grad=False)
    if first.bias is not None:
        fused.bias = nn.Parameter(torch.cat([m.bias for m in linears]), requires_grad=False)
    return fused


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.wk = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.wv = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.wo = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        self.scale = cfg.head_dim**-0.5
        self.sizes = [cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim]

    def fuse(self) -> None:
        """wq, wk, wv -> one wqkv: one matmul instead of three (after the weights are loaded)."""
        self.wqkv = fuse_linears([self.wq, self.wk, self.wv])
        del self.wq, self.wk, self.wv

    def forward(self, x, cos, sin, kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata):
        n = x.shape[0]
        q, k, v = self.wqkv(x).split(self.sizes, dim=-1)
        q = Rotary.apply(q.view(n, self.num_heads, self.head_dim), cos, sin)
        k = Rotary.apply(k.view(n, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        o = paged_attention(q, k_cache, v_cache, meta, self.scale)
        return self.wo(o.reshape(n, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)  # gate
        self.w2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)  # down
        self.w3 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)  # up

    def fuse(self) -> None:
        """w1 (gate) and w3 (up) -> one w13."""
        self.w13 = fuse_linears([self.w1, self.w3])
        del self.w1, self.w3

    def forward(self, x):
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention = Attention(cfg)
        self.feed_forward = FeedForward(cfg)
        self.attention_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, kv_cache, meta):
        h = x + self.attention(self.attention_norm(x), cos, sin, kv_cache, meta)
        return h + self.feed_forward(self.ffn_norm(h))


def run_layers(layers, x, cos, sin, kv_caches, meta: AttentionMetadata) -> torch.Tensor:
    for layer, kv_cache in zip(layers, kv_caches, strict=True):
        x = layer(x, cos, sin, kv_cache, meta)
    return x


class Llama(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.output = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta)
        # run_layers compiled for decode-only steps of up to compiled_max_batch rows, and how many
        # layers each call runs (set by compiled.py; max batch 0: never)
        self.compiled_run_layers = None
        self.compiled_max_batch = 0
        self.layers_per_call = cfg.num_layers

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def fuse_projections(self) -> None:
        """After loading: q/k/v and gate/up each become one matmul (forward expects them fused)."""
        for layer in self.layers:
            layer.attention.fuse()
            layer.feed_forward.fuse()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        """Ragged batch of new tokens [num_tokens] -> hidden states [num_tokens, hidden]."""
        cos, sin = self.rotary.cos_sin(positions)
        x = self.tok_embeddings(input_ids)
        if meta.prefills or input_ids.shape[0] > self.compiled_max_batch:
            x = run_layers(self.layers, x, cos, sin, kv_caches, meta)
        else:
            for i in range(0, len(self.layers), self.layers_per_call):
                j = i + self.layers_per_call
                x = self.compiled_run_layers(list(self.layers[i:j]), x, cos, sin, kv_caches[i:j], meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.output(hidden).float()
