"""The model architectures the engine serves, by the names a model file gives them: what the
worker's model registry implements, and what an upload is checked against before it is stored."""

from __future__ import annotations

# Hugging Face class names (config.json's `architectures`); services/worker/models/registry.py maps each to its code
HF_ARCHITECTURES = frozenset({
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM",
    "MixtralForCausalLM", "Qwen3MoeForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM",
    "Gemma3ForConditionalGeneration",  # Gemma 3 4B and up: its language model, and its image encoder (docs/images.md)
    "Qwen2_5_VLForConditionalGeneration",  # Qwen2.5-VL: Qwen2 with M-RoPE, and its vision transformer (docs/images.md)
    "BertModel",  # an encoder: embeddings and scores only, on the torch CPU backend
    "BertForSequenceClassification",  # a cross-encoder: /score and /rerank only
})
# encoders among them: bidirectional, pooled; they embed and score, and generate nothing
ENCODER_ARCHITECTURES = frozenset({"BertModel", "BertForSequenceClassification"})
# llama.cpp's architecture names (a GGUF's general.architecture) -> the Hugging Face class its tensors are
# (a `llama` file with routed experts is a Mixtral: llama.cpp writes Mixtral so)
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                      "qwen3moe": "Qwen3MoeForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
                      "phi3": "Phi3ForCausalLM"}


def servable_error(architecture: str, is_gguf: bool) -> str | None:
    """Why a model file of this architecture cannot be served, or None if it can."""
    if is_gguf and architecture not in GGUF_ARCHITECTURES:
        return (f"GGUF architecture {architecture!r} is not supported; known: {', '.join(GGUF_ARCHITECTURES)} "
                "(docs/models.md lists each family and its formats)")
    if not is_gguf and architecture not in HF_ARCHITECTURES:
        return (f"architecture {architecture!r} is not supported; known: {', '.join(sorted(HF_ARCHITECTURES))} "
                "(docs/models.md lists each family and its formats)")
    return None
