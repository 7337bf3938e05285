"""GGUF -> our weight names: dequantize with `gguf`, undo llama.cpp's Q/K rotary permutation (llama only).

The dequantized weights are cached as safetensors so a restart skips the slow part.
"""

from __future__ import annotations

import hashlib
import os

import msgspec
import numpy as np
import torch
from gguf.quants import dequantize
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from services.worker.model_config import ModelConfig
from services.worker.rope import RopeScaling
from shared.models.gguf_fields import read_fields, read_header
from shared.models.model_files import cache_dir_for

_LAYER_NAMES = {
    "attn_q": "attention.wq", "attn_k": "attention.wk", "attn_v": "attention.wv",
    "attn_output": "attention.wo", "ffn_gate": "feed_forward.w1", "ffn_down": "feed_forward.w2",
    "ffn_up": "feed_forward.w3", "attn_norm": "attention_norm", "ffn_norm": "ffn_norm",
    "attn_q_norm": "attention.q_norm", "attn_k_norm": "attention.k_norm",
    "post_attention_norm": "post_attention_norm", "post_ffw_norm": "post_ffn_norm",  # Gemma's (weights + 1 stored)
    "ffn_gate_inp": "feed_forward.gate",  # the experts' router
}
# each expert projection stacked over the experts ([E, out, in], as our parameters hold them)
_EXPERT_NAMES = {"ffn_gate_exps": "feed_forward.w1", "ffn_up_exps": "feed_forward.w3", "ffn_down_exps": "feed_forward.w2"}
_TOP_NAMES = {"token_embd": "tok_embeddings", "output_norm": "norm", "output": "output", "rope_freqs": "rope_freqs",
              "rope_factors_short": "rope_factors_short", "rope_factors_long": "rope_factors_long"}


def our_name(gguf_name: str) -> str:
    """'blk.3.attn_q.weight' -> 'layers.3.attention.wq.weight'."""
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _EXPERT_NAMES and parts[3] == "weight":
        return f"layers.{parts[1]}.{_EXPERT_NAMES[parts[2]]}"
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _LAYER_NAMES:
        return f"layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _TOP_NAMES:
        return f"{_TOP_NAMES[parts[0]]}.{parts[1]}"
    raise ValueError(f"GGUF tensor {gguf_name!r} is not one this engine reads")


def fused_rows(gguf_name: str, config: ModelConfig) -> list[tuple[str, int]] | None:
    """A fused projection's parts in row order, each our weight name and its rows: phi3's attn_qkv
    (q, k, v) and ffn_up (gate rows, then up rows, as HF's gate_up_proj). None: not fused."""
    parts = gguf_name.split(".")
    if config.architecture != "Phi3ForCausalLM" or len(parts) != 4 or parts[0] != "blk" or parts[3] != "weight":
        return None
    layer = f"layers.{parts[1]}."
    if parts[2] == "attn_qkv":
        q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        return [(layer + "attention.wq.weight", q), (layer + "attention.wk.weight", kv),
                (layer + "attention.wv.weight", kv)]
    if parts[2] == "ffn_up":
        return [(layer + "feed_forward.w1.weight", config.intermediate_size),
                (layer + "feed_forward.w3.weight", config.intermediate_size)]
    return None


def split_rows(parts: list[tuple[str, int]], rows: np.ndarray) -> dict[str, np.ndarray]:
    bounds = np.cumsum([n for _, n in parts])
    if bounds[-1] != rows.shape[0]:
        raise ValueError(f"a fused tensor of {rows.shape[0]} rows, where the config makes {bounds[-1]}")
    return {name: part for (name, _), part in zip(parts, np.split(rows, bounds[:-1]), strict=True)}


def rows_permuted(config: ModelConfig) -> bool:
    """llama.cpp's converter permutes Q and K rows for its llama architecture only (Mixtral's among
    them; Qwen's and Gemma's it keeps)."""
    return config.architecture in ("LlamaForCausalLM", "MixtralForCausalLM")


def unpermute_rotary(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp interleaves each head's rotary halves; Hugging Face's layout splits them."""
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def config_of(path: str) -> ModelConfig:
    fields = read_fields(path)
    return ModelConfig.from_gguf_fields(fields, has_output_weight="output.weight" in fields["__tensor_names__"])


def load(path: str, skip: frozenset[str] = frozenset()) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The config and every weight dequantized to float32, but those named in `skip` (kept in their
    blocks by the caller: gguf_blocks.py)."""
    fields = read_fields(path)
    config = ModelConfig.from_gguf_fields(fields, has_output_weight="output.weight" in fields["__tensor_names__"])
    kind = "weights-v1" if not skip else "weights-v1-without-" + hashlib.sha256("|".join(sorted(skip)).encode()).hexdigest()[:12]
    cached = cache_dir_for(path, kind) / "model.safetensors"
    if cached.exists():
        return _with_rope_freqs(config, load_file(str(cached)), fields)
    state_dict = {}
    for tensor in tqdm(read_header(path).tensors, desc="dequantizing GGUF", unit="tensor"):
        fused = fused_rows(tensor.name, config)
        names = [name for name, _ in fused] if fused else [our_name(tensor.name)]
        if all(name in skip for name in names):
            continue
        w = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        w = w.reshape([int(d) for d in reversed(tensor.shape)])
        if rows_permuted(config) and tensor.name.endswith(("attn_q.weight", "attn_k.weight")):
            w = unpermute_rotary(w, config.num_heads if tensor.name.endswith("attn_q.weight") else config.num_kv_heads)
        named = split_rows(fused, w) if fused else {names[0]: w}
        for name, rows in named.items():
            state_dict[name] = torch.from_numpy(np.array(rows, dtype=np.float32, order="C", copy=True))
    tmp = cached.with_suffix(f".{os.getpid()}.tmp")  # several workers may build it at once
    save_file(state_dict, str(tmp))
    tmp.rename(cached)  # atomic: a concurrent loader never reads half a file
    return _with_rope_freqs(config, state_dict, fields)


def _with_rope_freqs(config: ModelConfig, state_dict: dict, fields: dict) -> tuple[ModelConfig, dict]:
    """Llama 3.1+ GGUFs carry their rope scaling as a tensor of per-frequency divisors (rope_freqs);
    phi3's LongRoPE as its short and long factors, with the original length and attention factor
    as keys (transformers' longrope: the short factors within the original length)."""
    factors = state_dict.pop("rope_freqs.weight", None)
    if factors is not None:
        config = msgspec.structs.replace(config, rope_freq_factors=factors.float().tolist())
    short, long = state_dict.pop("rope_factors_short.weight", None), state_dict.pop("rope_factors_long.weight", None)
    if short is not None and long is not None:
        arch = fields["general.architecture"]
        attn = fields.get(f"{arch}.rope.scaling.attn_factor")
        config = msgspec.structs.replace(config, rope_scaling=RopeScaling(
            rope_type="longrope", short_factor=short.float().tolist(), long_factor=long.float().tolist(),
            original_max_position_embeddings=int(fields[f"{arch}.rope.scaling.original_context_length"]),
            attention_factor=float(attn) if attn is not None else None))
    return config, state_dict
