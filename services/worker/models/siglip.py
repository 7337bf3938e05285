"""Gemma 3's image encoder: a SigLIP vision transformer and the projector that pools its patches
into the language model's image tokens (`[images, 3, H, W]` pixels -> `[images, tokens, hidden]`)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.vision_config import VisionConfig


class EncoderLayer(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(cfg.hidden_size, cfg.hidden_size)
                                                                for _ in range(4))
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [images, patches, hidden]; every patch sees every patch of its image."""
        n, p, h = x.shape
        y = self.layer_norm1(x)
        q, k, v = (proj(y).view(n, p, self.num_heads, -1).transpose(1, 2) for proj in (self.q_proj, self.k_proj, self.v_proj))
        attn = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(n, p, h)
        x = x + self.out_proj(attn)
        return x + self.fc2(F.gelu(self.fc1(self.layer_norm2(x)), approximate="tanh"))


class Gemma3VisionTower(nn.Module):
    """SigLIP (patch embedding, learned positions, pre-norm layers, a final LayerNorm), then the
    projector: the patch grid average-pooled to mm_tokens_per_image, RMS-normed (Gemma's 1 + w,
    the 1 added at load, as to the language model's norms) and projected to its width."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.config = cfg
        self.patch_embedding = nn.Conv2d(3, cfg.hidden_size, kernel_size=cfg.patch_size, stride=cfg.patch_size)
        self.position_embedding = nn.Parameter(torch.zeros(cfg.patches_per_side ** 2, cfg.hidden_size))
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.num_layers))
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.soft_emb_norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.input_projection = nn.Parameter(torch.zeros(cfg.hidden_size, cfg.text_hidden_size))

    def encode(self, images: list[torch.Tensor]) -> list[torch.Tensor]:
        """images: RGB uint8 [image_size, image_size, 3] -> each one's features [tokens, text hidden], in one batch."""
        raw = torch.stack(images).to(self.position_embedding.device)
        pixels = (raw.permute(0, 3, 1, 2).float() / 255 - 0.5) / 0.5  # Gemma 3's processor's
        return list(self(pixels))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels: [images, 3, image_size, image_size], normalized -> [images, mm_tokens_per_image, text hidden]."""
        cfg = self.config
        x = self.patch_embedding(pixels.to(self.position_embedding.dtype)).flatten(2).transpose(1, 2)
        x = x + self.position_embedding
        for layer in self.layers:
            x = layer(x)
        x = self.post_layernorm(x)
        n, side = x.shape[0], cfg.patches_per_side
        grid = x.transpose(1, 2).reshape(n, cfg.hidden_size, side, side)
        kernel = side // math.isqrt(cfg.mm_tokens_per_image)
        pooled = F.avg_pool2d(grid, kernel_size=kernel, stride=kernel).flatten(2).transpose(1, 2)
        normed = pooled.float() * torch.rsqrt(pooled.float().pow(2).mean(-1, keepdim=True) + cfg.layer_norm_eps)
        normed = (normed * self.soft_emb_norm.float()).to(pooled.dtype)
        return normed @ self.input_projection


def vision_weight_name(hf_name: str) -> str | None:
    """A Gemma 3 checkpoint's vision weight -> the tower's name, as transformers 4's layout
    (`vision_tower.vision_model.`, the Hub's files), 5's modules (`model.vision_tower.`) and 5's
    files (`vision_tower.`) name them. None: not a weight the tower runs (SigLIP's unused head)."""
    name = hf_name.removeprefix("model.")
    if name.startswith("multi_modal_projector."):
        return {"multi_modal_projector.mm_input_projection_weight": "input_projection",
                "multi_modal_projector.mm_soft_emb_norm.weight": "soft_emb_norm"}.get(name)
    if not name.startswith("vision_tower."):
        return None
    name = name.removeprefix("vision_tower.").removeprefix("vision_model.")
    if name.startswith("embeddings."):
        return {"embeddings.patch_embedding.weight": "patch_embedding.weight",
                "embeddings.patch_embedding.bias": "patch_embedding.bias",
                "embeddings.position_embedding.weight": "position_embedding"}.get(name)
    if name.startswith("post_layernorm."):
        return name
    if name.startswith("encoder.layers."):
        _, _, idx, rest = name.split(".", 3)
        return f"layers.{idx}.{rest.removeprefix('self_attn.').removeprefix('mlp.')}"
    return None
