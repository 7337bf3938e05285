"""Random weights for a real config.json: benchmarks of larger shapes without their weights."""

from __future__ import annotations

from pathlib import Path

import torch
from tqdm import tqdm

from services.worker.backends.torch_cpu.ops import TORCH_OPS
from services.worker.model_config import ModelConfig
from services.worker.models import model_class_for


def load(path: str) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    config_path = Path(path) / "config.json" if Path(path).is_dir() else Path(path)
    config = ModelConfig.from_hf_config(config_path)
    with torch.device("meta"):
        shapes = model_class_for(config.architecture)(config, TORCH_OPS).state_dict()
    generator = torch.Generator().manual_seed(0)
    state_dict = {}
    for name, meta in tqdm(shapes.items(), desc="random weights", unit="tensor"):
        if name.endswith("norm.weight"):
            state_dict[name] = torch.ones(meta.shape)
        elif name.endswith(".bias"):
            state_dict[name] = torch.zeros(meta.shape)
        else:
            state_dict[name] = torch.randn(meta.shape, generator=generator) * 0.02
    return config, state_dict
