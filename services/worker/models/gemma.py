"""Gemma 2 and 3: sliding-window layers interleaved with global ones (Gemma 3's with a rope base of
their own), norms before and after attention and the MLP, GeGLU, embeddings scaled by sqrt(hidden);
Gemma 2 soft-caps its attention scores and logits, Gemma 3 norms each head's q and k instead.

Gemma's norms multiply by (1 + weight); the loader adds the 1 to each norm weight of a Hugging Face
checkpoint (llama.cpp's GGUFs store it added), so the backends' RMSNorm serves it as it is.
"""

from __future__ import annotations

import torch
from torch import nn

from services.worker.backends.base import LayerOps
from services.worker.model_config import ModelConfig
from services.worker.models.image_tokens import ImageTokens
from services.worker.models.llama import Attention, FeedForward, Llama, RMSNorm, Rotary
from services.worker.models.qwen3 import Qwen3Attention
from services.worker.models.siglip import Gemma3VisionTower
from services.worker.rope import RopeScaling, inv_freq


class LocalGlobalRotary(nn.Module):
    """cos and sin for the global layers (rope_theta, scaled as configured) and for the sliding ones
    (their own base, unscaled, where the config gives one): ((cos_global, cos_local), (sin_...))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.full = Rotary(cfg)
        self.local = Rotary(cfg)
        if cfg.local_rope_theta is not None:
            self.local.inv_freq = inv_freq(cfg.rotary_dim or cfg.head_dim, cfg.local_rope_theta, RopeScaling())

    def cos_sin(self, positions: torch.Tensor):
        (cos_g, sin_g), (cos_l, sin_l) = self.full.cos_sin(positions), self.local.cos_sin(positions)
        return (cos_g, cos_l), (sin_g, sin_l)


class Gemma2Block(nn.Module):
    attention_class = Attention  # the window, the soft cap and the query scalar are the config's

    def __init__(self, cfg: ModelConfig, ops: LayerOps, layer: int):
        super().__init__()
        self.attention = self.attention_class(cfg, ops, layer)
        self.feed_forward = FeedForward(cfg, ops)
        self.attention_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.post_attention_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.post_ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.rope = int(self.attention.window is not None)  # which (global, local) cos/sin it rotates with

    def forward(self, x, residual, cos, sin, kv_cache, meta):
        h, residual = self.attention_norm(x, residual)
        h = self.post_attention_norm.alone(self.attention(h, cos[self.rope], sin[self.rope], kv_cache, meta))
        h, residual = self.ffn_norm(h, residual)
        return self.post_ffn_norm.alone(self.feed_forward(h)), residual


class Gemma3Block(Gemma2Block):
    attention_class = Qwen3Attention  # and q/k norms per head


class Gemma2(Llama):
    block_class = Gemma2Block
    rotary_class = LocalGlobalRotary

    def forward(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:
        cos, sin = self.rotary.cos_sin(positions)
        x = self.embed(input_ids)
        x, residual = self.layer_runner(self.layers, x, torch.zeros_like(x), cos, sin, kv_caches, meta)
        return self.norm(x, residual)[0]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(input_ids)
        return x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)  # rounded to the dtype, as transformers

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.output(hidden).float()
        if (cap := self.config.final_logit_softcapping) is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits


class Gemma3(Gemma2):
    block_class = Gemma3Block


class Gemma3Vision(ImageTokens, Gemma3):
    """Gemma3ForConditionalGeneration: Gemma 3's language model and its image encoder (siglip.py).
    An image's features take the place of its image tokens' embeddings, and its tokens see each
    other both ways in a prefill (the attention's `bidirectional` spans), as transformers masks them."""

    images_see_both_ways = True

    def __init__(self, cfg: ModelConfig, ops: LayerOps):
        super().__init__(cfg, ops)
        self.vision = Gemma3VisionTower(cfg.vision)
