"""A Hugging Face directory: config.json + *.safetensors, renamed to our weight names (a quantized
checkpoint's Linears dequantized, or kept as the file has them: hf_quant.py)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from services.worker.loader import hf_quant
from services.worker.loader.quant_blocks import QuantBlocks
from services.worker.model_config import ModelConfig
from services.worker.models.qwen_vit import qwen_vision_weight_name
from services.worker.models.siglip import vision_weight_name
from services.worker.quant_scheme import scheme_of
from shared.log import get_logger
from shared.models.architectures import ENCODER_ARCHITECTURES

_LAYER_NAMES = {
    "self_attn.q_proj": "attention.wq", "self_attn.k_proj": "attention.wk",
    "self_attn.v_proj": "attention.wv", "self_attn.o_proj": "attention.wo",
    "mlp.gate_proj": "feed_forward.w1", "mlp.down_proj": "feed_forward.w2",
    "mlp.up_proj": "feed_forward.w3", "input_layernorm": "attention_norm",
    "post_attention_layernorm": "ffn_norm", "self_attn.q_norm": "attention.q_norm",
    "self_attn.k_norm": "attention.k_norm", "block_sparse_moe.gate": "feed_forward.gate",
    "mlp.gate": "feed_forward.gate",
}
# an expert's projections (Mixtral's, Qwen3-MoE's) -> our stacked [experts, out, in] parameters
_EXPERT_NAMES = {"w1": "w1", "w3": "w3", "w2": "w2", "gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
# Gemma normalizes after attention and after the MLP too: its post_attention_layernorm is not the MLP's
_GEMMA_NAMES = _LAYER_NAMES | {"post_attention_layernorm": "post_attention_norm",
                               "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffn_norm"}
_TOP_NAMES = {"model.embed_tokens": "tok_embeddings", "model.norm": "norm", "lm_head": "output"}
# checkpoints that store projections fused (Phi-3): split into ours (load_model fuses them again)
_FUSED = {"self_attn.qkv_proj": ("attention.wq", "attention.wk", "attention.wv"),
          "mlp.gate_up_proj": ("feed_forward.w1", "feed_forward.w3")}


def _split(hf_name: str, tensor, config: ModelConfig) -> dict | None:
    """'model.layers.3.self_attn.qkv_proj.weight' -> its q, k and v rows by our names (None: not
    fused). `tensor` is the weight, or its QuantBlocks."""
    stem, kind = hf_name.rsplit(".", 1)
    if not stem.startswith("model.layers."):
        return None
    _, _, idx, rest = stem.split(".", 3)
    if rest not in _FUSED:
        return None
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    sizes = [q, kv, kv] if rest == "self_attn.qkv_proj" else [config.intermediate_size] * 2
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    parts = [tensor[a:a + n] if isinstance(tensor, torch.Tensor) else tensor.rows(a, a + n)
             for a, n in zip(starts, sizes, strict=True)]
    return {f"layers.{idx}.{ours}.{kind}": part for ours, part in zip(_FUSED[rest], parts, strict=True)}


def our_name(hf_name: str, architecture: str = "") -> str | None:
    """'model.layers.3.self_attn.q_proj.weight' -> 'layers.3.attention.wq.weight'."""
    if architecture in ENCODER_ARCHITECTURES:  # models/bert.py keeps transformers' names; the pooler is unused
        name = hf_name.removeprefix("bert.")
        unused = ("cls.",) if architecture == "BertForSequenceClassification" else ("pooler.", "cls.")
        return None if name.startswith(unused) or name.endswith("position_ids") else name
    if architecture == "Gemma3ForConditionalGeneration":  # two towers in one file
        if (vision := vision_weight_name(hf_name)) is not None:
            return f"vision.{vision}"
        hf_name = _language_model_name(hf_name)
    if architecture == "Qwen2_5_VLForConditionalGeneration":
        if (vision := qwen_vision_weight_name(hf_name)) is not None:
            return f"vision.{vision}"
        hf_name = _language_model_name(hf_name)
    stem, kind = hf_name.rsplit(".", 1)
    names = _GEMMA_NAMES if is_gemma(architecture) else _LAYER_NAMES
    if stem.startswith("model.layers."):
        _, _, idx, rest = stem.split(".", 3)
        if rest not in names:
            return None  # e.g. rotary inv_freq buffers saved by old checkpoints
        return f"layers.{idx}.{names[rest]}.{kind}"
    return f"{_TOP_NAMES[stem]}.{kind}" if stem in _TOP_NAMES else None


def _language_model_name(hf_name: str) -> str:
    """An image-text checkpoint's language model weight as a causal LM's file names it: transformers
    4's (the Hub's) `language_model.model.` and 5's `model.language_model.` both become `model.`."""
    for prefix, ours in (("language_model.model.", "model."), ("model.language_model.", "model."),
                         ("language_model.lm_head.", "lm_head.")):
        if hf_name.startswith(prefix):
            return ours + hf_name.removeprefix(prefix)
    return hf_name


def is_gemma(architecture: str) -> bool:
    return architecture.startswith("Gemma")


def _gemma_norm(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """Gemma's norms multiply by (1 + weight), ours by weight: the 1 is added here, once (the
    vision tower's LayerNorms are plain; its projector's RMSNorm is Gemma's)."""
    if name.startswith("vision."):
        return tensor + 1.0 if name == "vision.soft_emb_norm" else tensor
    return tensor + 1.0 if name.rsplit(".", 2)[-2].endswith("norm") else tensor


def _expert(hf_name: str) -> tuple[str, int] | None:
    """'model.layers.3.mlp.experts.7.up_proj.weight' -> ('layers.3.feed_forward.w3', 7)."""
    parts = hf_name.split(".")
    if len(parts) == 8 and parts[:2] == ["model", "layers"] and parts[4] == "experts" and parts[7] == "weight" \
            and parts[3] in ("mlp", "block_sparse_moe") and parts[6] in _EXPERT_NAMES:
        return f"layers.{parts[2]}.feed_forward.{_EXPERT_NAMES[parts[6]]}", int(parts[5])
    return None


def _stacked(experts: dict[str, dict[int, torch.Tensor]], num_experts: int) -> dict[str, torch.Tensor]:
    out = {}
    for name, by_index in experts.items():
        if sorted(by_index) != list(range(num_experts)):
            raise ValueError(f"{name}: the checkpoint has experts {sorted(by_index)}, the config {num_experts}")
        out[name] = torch.stack([by_index[e] for e in range(num_experts)])
    return out


def _module_tensors(f, parts: dict[str, str]) -> dict[str, torch.Tensor]:
    return {suffix: f.get_tensor(name) for suffix, name in parts.items()}


def read_blocks(path: str) -> dict[str, QuantBlocks]:
    """A quantized checkpoint's (AWQ, GPTQ, compressed-tensors int or fp8) Linears as QuantBlocks by our
    weight names, a fused projection's parts split by rows ({} where it has none, or is not
    quantized; the experts' stay dense)."""
    root = Path(path)
    config = ModelConfig.from_hf_config(root / "config.json")
    scheme = scheme_of(json.loads((root / "config.json").read_text()), str(root / "config.json"))
    if scheme is None:
        return {}
    out = {}
    for file in sorted(root.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for module, parts in hf_quant.quantized_modules(list(f.keys())).items():
                name = f"{module}.weight"
                if _expert(name) is not None:
                    continue
                blocks = hf_quant.decode(_module_tensors(f, parts), scheme, f"{file.name}: {module}")
                if blocks is None:
                    continue
                split = _split(name, blocks, config)
                if split is not None:
                    out.update(split)
                elif (ours := our_name(name, config.architecture)) is not None:
                    out[ours] = blocks
    if config.tie_word_embeddings and "tok_embeddings.weight" in out:
        out.setdefault("output.weight", out["tok_embeddings.weight"])
    return out


def load(path: str, unloaded: frozenset[str] = frozenset()) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Every weight by our name in float32 (a quantized checkpoint's dequantized as its format does),
    but those in `unloaded` (kept as read_blocks gives them)."""
    root = Path(path)
    config = ModelConfig.from_hf_config(root / "config.json")
    scheme = scheme_of(json.loads((root / "config.json").read_text()), str(root / "config.json"))
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no *.safetensors files")
    if scheme is not None and scheme.activations:  # what the checkpoint asks and this engine does not do
        get_logger("worker").warning("checkpoint_activations", method=scheme.method, activations=scheme.activations)
    state_dict, experts = {}, {}

    def place(name: str, tensor: torch.Tensor) -> None:
        if (expert := _expert(name)) is not None:
            experts.setdefault(expert[0], {})[expert[1]] = tensor.float()
        elif (parts := _split(name, tensor, config)) is not None:
            state_dict.update((k, v.float()) for k, v in parts.items() if k not in unloaded)
        elif (ours := our_name(name, config.architecture)) is not None and ours not in unloaded:
            state_dict[ours] = tensor.float()

    for file in tqdm(files, desc="loading safetensors", unit="file"):
        with safe_open(str(file), framework="pt") as f:
            quantized = hf_quant.quantized_modules(list(f.keys())) if scheme is not None else {}
            taken = {name for parts in quantized.values() for name in parts.values()}
            for module, parts in quantized.items():
                name = f"{module}.weight"
                ours = list(_split(name, torch.empty(0, 0), config) or [our_name(name, config.architecture)])
                if all(o in unloaded for o in ours):
                    continue
                place(name, hf_quant.dequantize(_module_tensors(f, parts), scheme, f"{file.name}: {module}"))
            for name in f.keys():
                if name not in taken:
                    place(name, f.get_tensor(name))
    if is_gemma(config.architecture):
        state_dict = {name: _gemma_norm(name, t) for name, t in state_dict.items()}
    return config, state_dict | _stacked(experts, config.num_experts)
