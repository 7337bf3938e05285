"""A LoRA adapter as PEFT saves it (adapter_config.json + adapter_model.safetensors), checked against
the base model it is to run on; anything it cannot apply exactly is refused by name."""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load

from services.worker.model_config import ModelConfig

# PEFT's module names (transformers' Llama-shaped layers) -> (our fused Linear, its slice)
TARGETS = {"q_proj": ("wqkv", 0), "k_proj": ("wqkv", 1), "v_proj": ("wqkv", 2), "o_proj": ("wo", 0),
           "gate_proj": ("w13", 0), "up_proj": ("w13", 1), "down_proj": ("w2", 0)}
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
# adapter_config.json fields that change the computation; a value other than these is refused
_PLAIN = {"use_dora": False, "bias": "none", "modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {},
          "fan_in_fan_out": False, "lora_bias": False, "layers_to_transform": None, "target_parameters": None,
          "use_qalora": False, "megatron_config": None, "layer_replication": None, "trainable_token_indices": None}


class LoraError(ValueError):
    """An adapter this server cannot apply: the message names what (a 400 at the API)."""


@dataclass
class LoraAdapter:
    name: str
    path: str
    rank: int
    scaling: float  # lora_alpha / r (rsLoRA: / sqrt(r)), folded into B when the adapter takes a slot
    digest: str  # of its files: what it computes, which the prefix cache's hashes carry (a reload changes it)
    # (layer, PEFT module name) -> (A [r, in], B [out, r]) in float32
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def num_bytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


def module_shape(cfg: ModelConfig, module: str) -> tuple[int, int]:
    """(in, out) of a PEFT target module of the base model."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"q_proj": (cfg.hidden_size, q), "k_proj": (cfg.hidden_size, kv), "v_proj": (cfg.hidden_size, kv),
            "o_proj": (q, cfg.hidden_size), "gate_proj": (cfg.hidden_size, cfg.intermediate_size),
            "up_proj": (cfg.hidden_size, cfg.intermediate_size),
            "down_proj": (cfg.intermediate_size, cfg.hidden_size)}[module]


def load_adapter(name: str, path: str, cfg: ModelConfig, max_rank: int) -> LoraAdapter:
    """Read and check a PEFT LoRA directory for this base model; LoraError says what does not fit."""
    folder = Path(path)
    config_file, weights_file = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    if not config_file.is_file():
        raise LoraError(f"LoRA adapter {name!r}: no adapter_config.json in {path!r}")
    if not weights_file.is_file():
        raise LoraError(f"LoRA adapter {name!r}: no adapter_model.safetensors in {path!r} (PEFT's safetensors only)")
    raw = json.loads(config_file.read_text())
    if raw.get("peft_type", "LORA") != "LORA":
        raise LoraError(f"LoRA adapter {name!r}: peft_type {raw['peft_type']!r} is not LoRA")
    for field, plain in _PLAIN.items():
        if raw.get(field) not in (plain, None) and not (plain == {} and not raw.get(field)):
            raise LoraError(f"LoRA adapter {name!r}: {field}={raw[field]!r} is not supported")
    rank = int(raw["r"])
    if rank > max_rank:
        raise LoraError(f"LoRA adapter {name!r}: rank {rank} is over --max-lora-rank {max_rank}")
    if cfg.num_experts and _targets(raw) & {"gate_proj", "up_proj", "down_proj"}:
        raise LoraError(f"LoRA adapter {name!r}: {cfg.architecture}'s MLP is routed experts, which take no LoRA here")
    alpha = float(raw.get("lora_alpha", rank))
    scaling = alpha / math.sqrt(rank) if raw.get("use_rslora") else alpha / rank
    data = weights_file.read_bytes()
    digest = hashlib.sha256(config_file.read_bytes() + b"\0" + data).hexdigest()[:16]
    return LoraAdapter(name, str(folder), rank, scaling, digest, _weights(name, load(data), cfg, rank))


def _targets(raw: dict) -> set[str]:
    targets = raw.get("target_modules") or []
    return {targets} if isinstance(targets, str) else set(targets)


def _weights(name: str, tensors: dict[str, torch.Tensor], cfg: ModelConfig,
             rank: int) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.search(key)
        if match is None:
            raise LoraError(f"LoRA adapter {name!r}: tensor {key!r} is not a LoRA weight of a decoder layer")
        layer, module, half = int(match[1]), match[2], match[3]
        if module not in TARGETS:
            raise LoraError(f"LoRA adapter {name!r}: target module {module!r} is not one this model has "
                            f"(it takes {', '.join(TARGETS)})")
        if layer >= cfg.num_layers:
            raise LoraError(f"LoRA adapter {name!r} is for another base model: it has layer {layer}, "
                            f"{cfg.architecture} here has {cfg.num_layers}")
        halves.setdefault((layer, module), {})[half] = tensor.float()
    weights = {}
    for (layer, module), pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            raise LoraError(f"LoRA adapter {name!r}: {module} of layer {layer} lacks lora_{'B' if 'A' in pair else 'A'}")
        a, b = pair["A"], pair["B"]
        fan_in, fan_out = module_shape(cfg, module)
        if a.shape != (rank, fan_in) or b.shape != (fan_out, rank):
            raise LoraError(f"LoRA adapter {name!r} is for another base model: {module} of layer {layer} is "
                            f"A {list(a.shape)}, B {list(b.shape)}; this model's takes A [{rank}, {fan_in}], "
                            f"B [{fan_out}, {rank}]")
        weights[(layer, module)] = (a, b)
    if not weights:
        raise LoraError(f"LoRA adapter {name!r} holds no LoRA weights")
    return weights
