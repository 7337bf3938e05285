"""Qwen2.5-VL: Qwen2's language model with M-RoPE (a token's rotary turned by three positions: time,
row and column; a text token's three are equal), and its vision transformer (qwen_vit.py)."""

from __future__ import annotations

import torch

from services.worker.backends.base import LayerOps
from services.worker.model_config import ModelConfig
from services.worker.models.image_tokens import ImageTokens
from services.worker.models.llama import Llama, Rotary
from services.worker.models.qwen_vit import QwenVisionTower


class MRotary(Rotary):
    """positions [3, T]: the frequencies in mrope_section's sections, each turned by one of the
    three (section i by axis i % 3, as transformers splits them); [T]: a plain rotary."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.sections = list(cfg.mrope_section)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return super().cos_sin(positions)
        freqs = positions.float().unsqueeze(-1) * self.inv_freq  # [3, T, d/2]
        chosen = torch.cat([part[i % 3] for i, part in enumerate(freqs.split(self.sections, dim=-1))], dim=-1)
        emb = torch.cat([chosen, chosen], dim=-1)
        return emb.cos(), emb.sin()


class Qwen25VL(ImageTokens, Llama):
    rotary_class = MRotary

    def __init__(self, cfg: ModelConfig, ops: LayerOps):
        super().__init__(cfg, ops)
        self.vision = QwenVisionTower(cfg.vision)
