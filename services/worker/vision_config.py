"""An image-text model's vision tower, as its config.json describes it (Gemma 3's SigLIP and projector,
Qwen2.5-VL's vision transformer and its image processor's settings)."""

from __future__ import annotations

import json
import math
from pathlib import Path

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


_QWEN_VISION_READ = {"depth", "hidden_size", "intermediate_size", "num_heads", "patch_size", "temporal_patch_size",
                     "spatial_merge_size", "window_size", "fullatt_block_indexes", "out_hidden_size", "hidden_act",
                     "in_channels", "in_chans", "rope_parameters", "model_type", "spatial_patch_size"}
_QWEN_VISION_INERT = {"tokens_per_second", "initializer_range", "dtype", "torch_dtype", "transformers_version",
                      "_name_or_path", "architectures", "return_dict", "output_hidden_states", "id2label", "label2id",
                      "chunk_size_feed_forward", "is_encoder_decoder"}  # tokens_per_second: videos' (not served)
# Qwen2VLImageProcessor's: the pixel range an image is resized into, and its normalization (OpenAI CLIP's)
_QWEN_PIXELS = (56 * 56, 28 * 28 * 1280)
_CLIP_MEAN, _CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)


class QwenVisionConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Qwen2.5-VL's vision transformer (config.json's vision_config) and its image processor's
    settings (preprocessor_config.json beside it)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    patch_size: int
    temporal_patch_size: int  # a still image is its frame twice (the patch embedding reads two)
    merge_size: int  # merge_size x merge_size patches become one image token
    window_size: int  # pixels a side of the windows most layers attend within
    full_attention_layers: tuple[int, ...]  # the layers that attend over the whole image
    out_hidden_size: int
    rope_theta: float
    image_token_id: int
    start_token_id: int  # <|vision_start|>, <|vision_end|>
    end_token_id: int
    min_pixels: int
    max_pixels: int
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]

    @property
    def token_pixels(self) -> int:
        """Pixels a side of one image token."""
        return self.patch_size * self.merge_size

    @classmethod
    def from_qwen25vl(cls, raw: dict, config_file: Path, text_hidden_size: int, rotary_half: int,
                      mrope_section: tuple[int, ...]) -> QwenVisionConfig:
        """config.json's vision_config and token ids, preprocessor_config.json's settings beside it
        (transformers' defaults without one), checked against the language model's width and rotary."""
        path = str(config_file)
        if sum(mrope_section) != rotary_half:
            raise ConfigError(f"{path}: mrope_section {list(mrope_section)} does not split the rotary's "
                              f"{rotary_half} frequencies")
        processor_file = config_file.parent / "preprocessor_config.json"
        processor = json.loads(processor_file.read_text()) if processor_file.exists() else {}
        vision = raw.get("vision_config") or {}
        if unknown := sorted(set(vision) - _QWEN_VISION_READ - _QWEN_VISION_INERT):
            raise ConfigError(f"{path}: vision_config keys {unknown} are not implemented")
        if vision.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"{path}: vision hidden_act {vision['hidden_act']!r} is not implemented (silu)")
        if vision.get("in_channels", vision.get("in_chans", 3)) != 3:
            raise ConfigError(f"{path}: a vision tower of other than 3 channels is not implemented")
        if vision.get("spatial_patch_size", vision.get("patch_size", 14)) != vision.get("patch_size", 14):
            raise ConfigError(f"{path}: vision spatial_patch_size {vision['spatial_patch_size']} is not its patch_size")
        rope = vision.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ConfigError(f"{path}: vision rope type {rope['rope_type']!r} is not implemented (axial)")
        size = processor.get("size") or {}
        config = cls(
            hidden_size=vision.get("hidden_size", 3584), intermediate_size=vision.get("intermediate_size", 3420),
            num_layers=vision.get("depth", 32), num_heads=vision.get("num_heads", 16),
            patch_size=vision.get("patch_size", 14), temporal_patch_size=vision.get("temporal_patch_size", 2),
            merge_size=vision.get("spatial_merge_size", 2), window_size=vision.get("window_size", 112),
            full_attention_layers=tuple(vision.get("fullatt_block_indexes", (7, 15, 23, 31))),
            out_hidden_size=vision.get("out_hidden_size", 3584), rope_theta=float(rope.get("rope_theta", 10000.0)),
            image_token_id=raw.get("image_token_id", 151655), start_token_id=raw.get("vision_start_token_id", 151652),
            end_token_id=raw.get("vision_end_token_id", 151653),
            min_pixels=processor.get("min_pixels") or size.get("shortest_edge") or _QWEN_PIXELS[0],
            max_pixels=processor.get("max_pixels") or size.get("longest_edge") or _QWEN_PIXELS[1],
            image_mean=tuple(processor.get("image_mean", _CLIP_MEAN)), image_std=tuple(processor.get("image_std", _CLIP_STD)))
        for key in ("patch_size", "merge_size", "temporal_patch_size"):  # the processor's must be the tower's
            theirs = processor.get(key)
            if theirs is not None and theirs != getattr(config, key):
                raise ConfigError(f"{path}: preprocessor_config.json's {key} {theirs} is not the vision tower's "
                                  f"{getattr(config, key)}")
        if config.out_hidden_size != text_hidden_size:
            raise ConfigError(f"{path}: the vision tower's out_hidden_size {config.out_hidden_size} is not the "
                              f"language model's hidden_size {text_hidden_size}")
        if config.window_size % config.token_pixels:
            raise ConfigError(f"{path}: window_size {config.window_size} is not a whole number of image tokens "
                              f"({config.token_pixels} pixels)")
        return config


# the top level of a Qwen2_5_VLForConditionalGeneration config.json besides its language model's
# fields (transformers 4 writes those there too; 5 in text_config)
QWEN25VL_TOP_READ = {"architectures", "text_config", "vision_config", "image_token_id", "video_token_id",
                     "vision_start_token_id", "vision_end_token_id", "vision_token_id", "model_type"}


def qwen25vl_text_config(raw: dict, path: str) -> tuple[dict, tuple[int, ...]]:
    """A Qwen2_5_VLForConditionalGeneration's language model as a Qwen2ForCausalLM config.json would
    say it, and its M-RoPE sections (the rotary frequencies turned by a token's time, row and column)."""
    text = dict(raw.get("text_config") or {k: v for k, v in raw.items() if k not in QWEN25VL_TOP_READ})
    if raw.get("text_config") is not None and (
            unknown := sorted(k for k, v in raw.items() if k not in QWEN25VL_TOP_READ and k not in _TOP_INERT
                              and v not in (None, False, [], {}))):
        raise ConfigError(f"{path}: config field(s) {unknown} are not implemented by this engine")
    key = "rope_parameters" if "rope_parameters" in text else "rope_scaling"
    rope = dict(text.get(key) or {})
    sections = tuple(rope.pop("mrope_section", ()))
    if not sections:
        raise ConfigError(f"{path}: {key} gives no mrope_section (the M-RoPE split of Qwen2.5-VL's rotary)")
    if rope.get("rope_type", rope.get("type")) in ("mrope", "default", None):
        rope.pop("type", None)
        rope["rope_type"] = "default"
    text[key] = rope
    text.pop("model_type", None)
    if raw.get("tie_word_embeddings") is not None:  # transformers 5 writes it at the top
        text["tie_word_embeddings"] = raw["tie_word_embeddings"]
    return text | {"architectures": ["Qwen2ForCausalLM"]}, sections


_TOP_INERT = {"transformers_version", "torch_dtype", "dtype", "tie_word_embeddings", "_name_or_path",
              "initializer_range", "use_cache", "output_hidden_states", "return_dict", "id2label", "label2id",
              "pad_token_id", "bos_token_id", "eos_token_id", "problem_type", "chunk_size_feed_forward",
              "is_encoder_decoder"}
