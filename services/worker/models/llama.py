"""Llama (and the families that share its shape: Mistral, Qwen2) as the paper writes it.

The layers call the ops their backend hands them (`LayerOps`: attention over the paged KV cache,
norms, rotary, SwiGLU), so the same model runs on the torch CPU path and on the Triton kernels.
The residual stream is carried beside the hidden state, so a backend can fuse the add into the norm.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.backends.base import LayerOps
from services.worker.model_config import ModelConfig
from services.worker.rope import inv_freq


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, ops: LayerOps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.ops = ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual)."""
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)

    def alone(self, x: torch.Tensor) -> torch.Tensor:
        """norm(x), with no residual stream (Gemma's norms after attention and the MLP)."""
        return self.ops.rms_norm(x, self.weight, self.eps)


class Rotary(nn.Module):
    """Rotary position embedding in the Hugging Face (half-split) layout, its frequencies scaled as
    the config says (models/rope.py), or divided by a GGUF's rope_freqs factors."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        freqs = inv_freq(cfg.rotary_dim or cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        if cfg.rope_freq_factors is not None:
            freqs = freqs / torch.tensor(cfg.rope_freq_factors, dtype=torch.float32, device="cpu")
        self.register_buffer("inv_freq", freqs, persistent=False)
        self.magnitude = cfg.rope_scaling.magnitude(cfg.max_position_embeddings)  # LongRoPE's; else 1

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float().unsqueeze(-1) * self.inv_freq  # [T, d/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        if self.magnitude != 1.0:
            return emb.cos() * self.magnitude, emb.sin() * self.magnitude
        return emb.cos(), emb.sin()


def fuse_linears(linears: list[nn.Linear]) -> nn.Linear:
    """Linears over the same input, stacked into one whose output is their outputs side by side."""
    first = linears[0]
    # on meta: its own init skipped (the weights are assigned next)
    fused = nn.Linear(first.in_features, sum(m.out_features for m in linears), bias=first.bias is not None,
                      device="meta")
    fused.weight = nn.Parameter(_cat([m.weight for m in linears]), requires_grad=False)
    if first.bias is not None:
        fused.bias = nn.Parameter(_cat([m.bias for m in linears]), requires_grad=False)
    return fused


def _cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Weights still on meta (kept in their blocks, built by the backend) fuse into one of the whole
    shape without torch.cat, which on meta imports torch._dynamo (rope.inv_freq says why that matters)."""
    if tensors[0].is_meta:
        return torch.empty(sum(t.shape[0] for t in tensors), *tensors[0].shape[1:], dtype=tensors[0].dtype,
                           device="meta")
    return torch.cat(tensors)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: LayerOps, layer: int):
        super().__init__()
        self.ops = ops
        self.window = cfg.window_of(layer)  # a sliding-window layer's window; None: full attention
        self.softcap = cfg.attn_logit_softcapping  # Gemma 2's cap on the scores; None: none
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.wk = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.wv = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.wo = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        self.scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
        self.sizes = [cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim]

    def fuse(self) -> None:
        """wq, wk, wv -> one wqkv: one matmul instead of three (after the weights are loaded)."""
        self.wqkv = fuse_linears([self.wq, self.wk, self.wv])
        del self.wq, self.wk, self.wv

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[T, hidden] -> q [T, heads, d], k and v [T, kv_heads, d], before the rotary."""
        n = x.shape[0]
        q, k, v = self.wqkv(x).split(self.sizes, dim=-1)
        return (q.view(n, self.num_heads, self.head_dim), k.view(n, self.num_kv_heads, self.head_dim),
                v.view(n, self.num_kv_heads, self.head_dim))

    def forward(self, x, cos, sin, kv_cache: tuple[torch.Tensor, torch.Tensor], meta):
        q, k, v = self.qkv(x)
        q, k = self.ops.rotary(q, k, cos, sin)
        o = self.ops.attention(q, k, v, kv_cache, meta, self.scale, self.window, self.softcap)
        return self.wo(o.reshape(x.shape[0], -1))


class FeedForward(nn.Module):
    """The gated MLP: SwiGLU (the backend's op), or GeGLU with tanh's gelu (Gemma; torch's op)."""

    def __init__(self, cfg: ModelConfig, ops: LayerOps):
        super().__init__()
        self.ops = ops
        self.gelu = cfg.hidden_act == "gelu_pytorch_tanh"
        self.w1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)  # gate
        self.w2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)  # down
        self.w3 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)  # up

    def fuse(self) -> None:
        """w1 (gate) and w3 (up) -> one w13."""
        self.w13 = fuse_linears([self.w1, self.w3])
        del self.w1, self.w3

    def forward(self, x):
        if self.gelu:
            gate, up = self.w13(x).chunk(2, dim=-1)
            return self.w2(F.gelu(gate, approximate="tanh") * up)
        return self.w2(self.ops.silu_and_mul(self.w13(x)))


class TransformerBlock(nn.Module):
    attention_class = Attention
    feed_forward_class = FeedForward

    def __init__(self, cfg: ModelConfig, ops: LayerOps, layer: int):
        super().__init__()
        self.attention = self.attention_class(cfg, ops, layer)
        self.feed_forward = self.feed_forward_class(cfg, ops)
        self.attention_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)

    def forward(self, x, residual, cos, sin, kv_cache, meta):
        """x: the previous layer's output, residual: the stream before it; returns the same pair."""
        h, residual = self.attention_norm(x, residual)
        h, residual = self.ffn_norm(self.attention(h, cos, sin, kv_cache, meta), residual)
        return self.feed_forward(h), residual


def run_layers(layers, x, residual, cos, sin, kv_caches, meta) -> tuple[torch.Tensor, torch.Tensor]:
    for layer, kv_cache in zip(layers, kv_caches, strict=True):
        x, residual = layer(x, residual, cos, sin, kv_cache, meta)
    return x, residual


def run_layers_keeping(layers, x, residual, cos, sin, kv_caches, meta,
                       keep: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """run_layers, and the residual stream entering each layer in `keep` (len(layers): after the
    last), side by side [T, len(keep) * hidden]: what an EAGLE-3 head reads (models/eagle3.py)."""
    kept = {}
    for i, (layer, kv_cache) in enumerate(zip(layers, kv_caches, strict=True)):
        if i in keep:
            kept[i] = x + residual
        x, residual = layer(x, residual, cos, sin, kv_cache, meta)
    if len(layers) in keep:
        kept[len(layers)] = x + residual
    return x, residual, torch.cat([kept[i] for i in keep], -1)


class Llama(nn.Module):
    block_class = TransformerBlock
    rotary_class = Rotary  # made by the loader after the cast, in float32

    def __init__(self, cfg: ModelConfig, ops: LayerOps):
        super().__init__()
        self.config = cfg
        # the loaders build the model on meta and assign the weights: an Embedding's own init (normal_)
        # on meta would import torch._dynamo (rope.inv_freq says why that matters)
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                           _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(self.block_class(cfg, ops, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.output = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = self.rotary_class(cfg)
        # how the layers run: run_layers, or a backend's own (torch_cpu/compiled.py: compiled decode steps)
        self.layer_runner = run_layers
        self.lora = None  # the LoRA Linears' shared step state, once adapters are attached (lora/manager.py)
        # an EAGLE-3 head's layers: each forward keeps their input streams in aux_hidden (run eagerly)
        self.aux_layers: tuple[int, ...] = ()
        self.aux_hidden: torch.Tensor | None = None

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def fuse_projections(self) -> None:
        """After loading: q/k/v and gate/up each become one matmul (forward expects them fused)."""
        for layer in self.layers:
            layer.attention.fuse()
            layer.feed_forward.fuse()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta) -> torch.Tensor:
        """Ragged batch of new tokens [num_tokens] -> hidden states [num_tokens, hidden]."""
        cos, sin = self.rotary.cos_sin(positions)
        x = self.embed(input_ids)
        residual = torch.zeros_like(x)  # the stream starts empty: the first norm adds the embeddings to it
        # a step with adapter rows runs eagerly: compiled graphs were traced without them
        runner = run_layers if self.lora is not None and self.lora.rows is not None else self.layer_runner
        if self.aux_layers:
            x, residual, self.aux_hidden = run_layers_keeping(self.layers, x, residual, cos, sin, kv_caches, meta,
                                                              self.aux_layers)
        else:
            x, residual = runner(self.layers, x, residual, cos, sin, kv_caches, meta)
        return self.norm(x, residual)[0]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.tok_embeddings(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.output(hidden).float()
