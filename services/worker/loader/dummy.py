"""Random weights for a real config.json: benchmarks of larger shapes without their weights."""

from __future__ import annotations

from pathlib import Path

import torch
from tqdm import tqdm

from services.worker.backends.torch_cpu.ops import TORCH_OPS
from services.worker.model_config import ModelConfig
from services.worker.models import model_class_for


def load(path: str, dtype: torch.dtype = torch.float32,
         device: torch.device | str = "cpu") -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Each tensor drawn on the host from one seeded generator (the same weights on every device),
    then moved in `dtype`, one at a time (an 8B model never sits on the host in float32 whole)."""
    config_path = Path(path) / "config.json" if Path(path).is_dir() else Path(path)
    config = ModelConfig.from_hf_config(config_path)
    with torch.device("meta"):
        shapes = model_class_for(config.architecture)(config, TORCH_OPS).state_dict()
    generator = torch.Generator().manual_seed(0)
    state_dict = {}
    for name, meta in tqdm(shapes.items(), desc="random weights", unit="tensor"):
        if name.endswith("norm.weight"):
            weight = torch.ones(meta.shape)
        elif name.endswith(".bias"):
            weight = torch.zeros(meta.shape)
        else:
            weight = torch.randn(meta.shape, generator=generator) * 0.02
        state_dict[name] = weight.to(device=device, dtype=dtype)
    return config, state_dict
