"""An image-text model's vision tower, as its config.json describes it (Gemma 3's SigLIP and projector)."""

from __future__ import annotations

import math

import msgspec

from shared.config import ConfigError

_READ = {"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "patch_size",
         "image_size", "layer_norm_eps", "hidden_act", "num_channels", "model_type"}
# what transformers writes and Gemma 3's image features do not depend on (they read the last
# hidden state: SigLIP's pooling head, vision_use_head, is never run)
_INERT = {"attention_dropout", "dtype", "torch_dtype", "transformers_version", "projection_dim",
          "architectures", "_name_or_path", "id2label", "label2id", "return_dict", "output_hidden_states",
          "initializer_range", "chunk_size_feed_forward", "is_encoder_decoder", "tie_word_embeddings",
          "vision_use_head"}


class VisionConfig(msgspec.Struct, frozen=True, kw_only=True):
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    patch_size: int
    image_size: int
    layer_norm_eps: float
    mm_tokens_per_image: int  # image tokens the projector pools each image's patches into
    text_hidden_size: int
    image_token_id: int  # each image token's: its features take the token's place
    start_token_id: int  # the tokens around an image's run (Gemma 3's <start_of_image>, <end_of_image>)
    end_token_id: int

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @classmethod
    def from_gemma3(cls, raw: dict, text_hidden_size: int, path: str) -> VisionConfig:
        """A Gemma3ForConditionalGeneration config.json's vision_config and mm_tokens_per_image
        (transformers writes a sub-config's fields that differ from its class's: SigLIP's defaults
        fill the rest)."""
        vision = raw.get("vision_config") or {}
        if unknown := sorted(set(vision) - _READ - _INERT):
            raise ConfigError(f"{path}: vision_config keys {unknown} are not implemented")
        if vision.get("model_type", "siglip_vision_model") != "siglip_vision_model":
            raise ConfigError(f"{path}: a {vision['model_type']!r} vision tower is not implemented (SigLIP)")
        if vision.get("hidden_act", "gelu_pytorch_tanh") not in ("gelu_pytorch_tanh", "gelu_new"):
            raise ConfigError(f"{path}: vision hidden_act {vision['hidden_act']!r} is not implemented")
        if vision.get("num_channels", 3) != 3:
            raise ConfigError(f"{path}: a vision tower of {vision['num_channels']} channels is not implemented (3)")
        config = cls(hidden_size=vision.get("hidden_size", 768), intermediate_size=vision.get("intermediate_size", 3072),
                     num_layers=vision.get("num_hidden_layers", 12), num_heads=vision.get("num_attention_heads", 12),
                     patch_size=vision.get("patch_size", 16), image_size=vision.get("image_size", 224),
                     layer_norm_eps=float(vision.get("layer_norm_eps", 1e-6)),
                     mm_tokens_per_image=raw.get("mm_tokens_per_image", 256), text_hidden_size=text_hidden_size,
                     image_token_id=raw.get("image_token_index", 262144), start_token_id=raw.get("boi_token_index", 255999),
                     end_token_id=raw.get("eoi_token_index", 256000))
        side = math.isqrt(config.mm_tokens_per_image)
        if side * side != config.mm_tokens_per_image or config.patches_per_side % side:
            raise ConfigError(f"{path}: mm_tokens_per_image {config.mm_tokens_per_image} does not pool "
                              f"{config.patches_per_side}x{config.patches_per_side} patches evenly")
        return config


# Gemma3TextConfig's defaults: a Gemma3ForConditionalGeneration config.json's text_config holds
# only the fields that differ from them (transformers writes a sub-config so)
_GEMMA3_TEXT_DEFAULTS = {
    "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "eos_token_id": 1, "bos_token_id": 2,
    "tie_word_embeddings": True, "query_pre_attn_scalar": 256, "sliding_window": 4096, "sliding_window_pattern": 6,
}
_GEMMA3_ROPE_DEFAULTS = {"rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0}
# the top level of a Gemma3ForConditionalGeneration config.json: the two towers and how they meet
GEMMA3_TOP_READ = {"architectures", "text_config", "vision_config", "mm_tokens_per_image", "image_token_index",
                   "boi_token_index", "eoi_token_index", "eos_token_id", "bos_token_id", "pad_token_id",
                   "tie_word_embeddings", "model_type", "transformers_version", "torch_dtype", "dtype",
                   "initializer_range", "_name_or_path", "output_hidden_states", "return_dict", "use_cache",
                   "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id", "problem_type"}


def gemma3_text_config(raw: dict, path: str) -> dict:
    """A Gemma3ForConditionalGeneration's language model as a Gemma3ForCausalLM config.json would
    say it: its text_config over Gemma3TextConfig's defaults, the top level's token ids over both."""
    if unknown := sorted(k for k, v in raw.items() if k not in GEMMA3_TOP_READ and v not in (None, False, [], {})):
        raise ConfigError(f"{path}: config field(s) {unknown} are not implemented by this engine")
    text = dict(raw.get("text_config") or {})
    text.pop("model_type", None)
    rope = {} if "rope_parameters" in text else _GEMMA3_ROPE_DEFAULTS  # transformers 5 writes both bases there
    merged = _GEMMA3_TEXT_DEFAULTS | rope | text | {"architectures": ["Gemma3ForCausalLM"]}
    for key in ("eos_token_id", "bos_token_id", "tie_word_embeddings"):
        if raw.get(key) is not None:
            merged[key] = raw[key]
    return merged
