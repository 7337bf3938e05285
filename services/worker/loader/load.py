"""Pick the loader for an artifact, build the model on `meta`, then assign real weights."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from services.worker.backends.base import LayerOps
from services.worker.loader import dummy, gguf_blocks, gguf_file, hf_dir
from services.worker.loader.quant_blocks import QuantBlocks
from services.worker.model_config import ModelConfig
from services.worker.models import model_class_for
from shared.config import ConfigError
from shared.models.gguf_fields import is_gguf


@dataclass
class LoadedModel:
    model: torch.nn.Module
    config: ModelConfig
    source: str
    blocks: dict[str, QuantBlocks] | None = None  # a GGUF's or a quantized checkpoint's blocks, kept (`keep`)
    unloaded: frozenset[str] = frozenset()  # weights left on `meta`: the caller builds their modules from `blocks`


def detect_format(path: str, load_format: str) -> str:
    if load_format != "auto":
        return load_format
    if is_gguf(path):
        return "gguf"
    if os.path.isdir(path) and (Path(path) / "config.json").exists():
        return "hf"
    raise ValueError(f"{path}: neither a GGUF file nor a directory with config.json")


def refuse_encoder(loaded: LoadedModel, device: str) -> None:
    """The paged backends' kernels are causal: an encoder (models/bert.py) runs on the torch CPU backend."""
    if getattr(loaded.model, "is_encoder", False):
        raise ConfigError(f"{loaded.config.architecture} is an encoder (bidirectional attention over a whole "
                          f"prompt): it runs on the torch CPU backend (--device cpu), not on {device}")


def refuse_images(loaded: LoadedModel, device: str, why: str) -> None:
    """An image-text model on a backend that has no image path (docs/qaic.md says why for QAIC)."""
    if loaded.config.vision is not None:
        raise ConfigError(f"{loaded.config.architecture} is an image-text model, which the {device} backend does "
                          f"not serve: {why}")


def load_model(path: str, load_format: str = "auto", dtype: torch.dtype = torch.float32, *,
               ops: LayerOps, device: torch.device | str = "cpu",
               keep: Callable[[dict[str, QuantBlocks]], frozenset[str]] | None = None) -> LoadedModel:
    """The model with its weights in `dtype` on `device`, its layers calling `ops` (the backend's).
    keep (a GGUF, a quantized checkpoint): given the file's blocks (gguf_blocks.read, hf_dir.read_blocks),
    the weights the caller will build from them; those are never dequantized, and stay on `meta` in the model returned."""
    fmt = detect_format(path, load_format)
    blocks, unloaded = None, frozenset()
    if fmt in ("gguf", "hf") and keep is not None:
        blocks = (gguf_blocks.read(path, gguf_file.config_of(path)) if fmt == "gguf" else hf_dir.read_blocks(path)) or None
        unloaded = keep(blocks) if blocks else frozenset()
    if fmt == "gguf":
        config, state_dict = gguf_file.load(path, unloaded)
    elif fmt == "hf":
        config, state_dict = hf_dir.load(path, unloaded)
    else:
        config, state_dict = dummy.load(path, dtype, device)
    cls = model_class_for(config.architecture)
    with torch.device("meta"):
        model = cls(config, ops)
    if config.tie_word_embeddings:
        state_dict.pop("output.weight", None)
    missing, unexpected = model.load_state_dict(state_dict, strict=False, assign=True)
    missing = [m for m in missing if not (config.tie_word_embeddings and m == "output.weight") and m not in unloaded]
    if missing or unexpected:
        raise ValueError(f"{path}: weights do not match {config.architecture}: "
                         f"missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.tie_weights()
    model.fuse_projections()
    if getattr(cls, "is_encoder", False):  # BERT: absolute positions, no rotary
        return LoadedModel(model=model.to(device=device, dtype=dtype).eval(), config=config, source=f"{fmt}:{path}",
                           blocks=blocks, unloaded=unloaded)
    del model.rotary  # still on meta: its buffer is not in the state dict
    # weights left on meta (unloaded) cannot move: the others stay on the CPU, and the backend moves
    # the model once it has built the kept weights' modules (the CUDA backend)
    model = (model.to(dtype=dtype) if unloaded else model.to(device=device, dtype=dtype)).eval()
    # made after the cast, so its frequencies stay float32 (in bfloat16 they keep 3 significant
    # digits, and the angles drift by radians at long positions)
    model.rotary = cls.rotary_class(config).to(device)
    return LoadedModel(model=model, config=config, source=f"{fmt}:{path}", blocks=blocks, unloaded=unloaded)
