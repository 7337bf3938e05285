"""Architecture name -> model class (one file per family; Qwen2 and Mistral share the Llama code path)."""

from __future__ import annotations

from services.worker.models.bert import Bert, BertCrossEncoder
from services.worker.models.gemma import Gemma2, Gemma3, Gemma3Vision
from services.worker.models.llama import Llama
from services.worker.models.moe import Mixtral, Qwen3Moe
from services.worker.models.qwen2_vl import Qwen25VL
from services.worker.models.qwen3 import Qwen3

_REGISTRY: dict[str, type] = {
    "LlamaForCausalLM": Llama,
    "MistralForCausalLM": Llama,  # Llama + sliding-window attention
    "Qwen2ForCausalLM": Llama,  # Llama + q/k/v biases (config.attention_bias)
    "Qwen3ForCausalLM": Qwen3,  # Llama + q/k RMSNorm per head
    "Phi3ForCausalLM": Llama,  # Llama's layers; its checkpoints fuse qkv and gate_up (loader/hf_dir.py)
    "MixtralForCausalLM": Mixtral,  # Llama + top-k routed experts
    "Qwen3MoeForCausalLM": Qwen3Moe,  # Qwen3 + top-k routed experts
    "Gemma2ForCausalLM": Gemma2,  # sliding-window layers among global ones, four norms a layer, GeGLU, soft caps
    "Gemma3ForCausalLM": Gemma3,  # Gemma 2's layers, q/k norms in place of the soft caps, a local rope base
    "Gemma3ForConditionalGeneration": Gemma3Vision,  # Gemma 3's language model with its SigLIP image encoder
    "Qwen2_5_VLForConditionalGeneration": Qwen25VL,  # Qwen2 with M-RoPE, and its vision transformer
    "BertModel": Bert,  # an encoder: bidirectional, pooled (embeddings and scores only)
    "BertForSequenceClassification": BertCrossEncoder,  # an encoder scoring (query, document) pairs
}


def model_class_for(architecture: str) -> type:
    try:
        return _REGISTRY[architecture]
    except KeyError:
        known = ", ".join(sorted(_REGISTRY))
        raise ValueError(f"architecture {architecture!r} is not supported; known: {known}") from None
