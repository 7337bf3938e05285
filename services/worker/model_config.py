"""Architecture hyper-parameters, read from GGUF metadata or a Hugging Face config.json."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec


class ModelConfig(msgspec.Struct, kw_only=True):
    architecture: str  # Hugging Face class name, the registry key
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    max_position_embeddings: int = 2048
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = []

    @classmethod
    def from_hf_config(cls, path: str | Path) -> ModelConfig:
        raw = json.loads(Path(path).read_text())
        archs = raw.get("architectures") or []
        if not archs:
            raise ValueError(f"{path}: config.json names no architecture")
        if raw.get("rope_scaling"):
            raise ValueError(f"{path}: rope_scaling {raw['rope_scaling']} is not supported yet")
        eos = raw.get("eos_token_id")
        num_heads = raw["num_attention_heads"]
        return cls(
            architecture=archs[0],
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads", num_heads),
            head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
            rope_theta=float(raw.get("rope_theta", 10000.0)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", archs[0] == "Qwen2ForCausalLM")),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            sliding_window=raw.get("sliding_window") if raw.get("use_sliding_window", True) else None,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=[] if eos is None else (eos if isinstance(eos, list) else [eos]),
        )

    @classmethod
    def from_gguf_fields(cls, fields: dict, has_output_weight: bool) -> ModelConfig:
        arch = fields["general.architecture"]
        if arch != "llama":
            raise ValueError(f"GGUF architecture {arch!r} is not supported (llama only)")
        p = f"{arch}."
        num_heads = fields[p + "attention.head_count"]
        hidden = fields[p + "embedding_length"]
        eos = fields.get("tokenizer.ggml.eos_token_id")
        vocab = fields.get(p + "vocab_size") or len(fields["tokenizer.ggml.tokens"])
        return cls(
            architecture="LlamaForCausalLM",
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=fields[p + "feed_forward_length"],
            num_layers=fields[p + "block_count"],
            num_heads=num_heads,
            num_kv_heads=fields.get(p + "attention.head_count_kv", num_heads),
            head_dim=fields.get(p + "rope.dimension_count", hidden // num_heads),
            rope_theta=float(fields.get(p + "rope.freq_base", 10000.0)),
            rms_norm_eps=float(fields.get(p + "attention.layer_norm_rms_epsilon", 1e-5)),
            tie_word_embeddings=not has_output_weight,
            max_position_embeddings=fields.get(p + "context_length", 2048),
            bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=[] if eos is None else [eos],
        )
