"""Shrunk image-text checkpoints with random weights, saved by transformers (say so in reports):
Gemma 3 (2 layers, one sliding; 16x16 images of 4 tokens) and Qwen2.5-VL (2 layers each tower,
4-pixel patches: a token per 8x8 pixels; 16-pixel windows), with Qwen's image processor beside it;
and the pictures and chat messages the stack tests send them."""

from __future__ import annotations

import base64
import io

import numpy as np
import torch

GEMMA3_IMAGE, GEMMA3_BOI, GEMMA3_EOI = 299, 297, 298
GEMMA3_TOKENS_PER_IMAGE = 4
QWEN_IMAGE, QWEN_START, QWEN_END = 299, 297, 298


def _randomized(model):
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model.eval()


def gemma3_vision(folder) -> object:
    import transformers

    torch.manual_seed(0)
    config = transformers.Gemma3Config(
        text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=300, sliding_window=6,
                         layer_types=["sliding_attention", "full_attention"], max_position_embeddings=512),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           patch_size=4, image_size=16, vision_use_head=False),
        mm_tokens_per_image=GEMMA3_TOKENS_PER_IMAGE, image_token_index=GEMMA3_IMAGE, boi_token_index=GEMMA3_BOI,
        eoi_token_index=GEMMA3_EOI)
    model = _randomized(transformers.Gemma3ForConditionalGeneration(config))
    model.save_pretrained(folder)
    return model


def qwen25vl_processor(min_pixels: int = 64, max_pixels: int = 64 * 64):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(patch_size=4, merge_size=2, temporal_patch_size=2,
                                    size={"shortest_edge": min_pixels, "longest_edge": max_pixels})


def qwen25vl_config(vocab_size: int = 300, image: int = QWEN_IMAGE, start: int = QWEN_START, end: int = QWEN_END,
                    **text):
    import transformers

    return transformers.Qwen2_5_VLConfig(
        text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=vocab_size, max_position_embeddings=1024,
                         rope_parameters=dict(rope_type="default", mrope_section=[2, 3, 3], rope_theta=10000.0),
                         **text),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4,
                           spatial_merge_size=2, temporal_patch_size=2, window_size=16, out_hidden_size=64,
                           fullatt_block_indexes=[1]),
        image_token_id=image, video_token_id=image, vision_start_token_id=start, vision_end_token_id=end)


def qwen25vl(folder, config=None):
    """(the model, its image processor), both saved in `folder`."""
    import transformers

    torch.manual_seed(0)
    model = _randomized(transformers.Qwen2_5_VLForConditionalGeneration(config or qwen25vl_config()))
    model.save_pretrained(folder)
    processor = qwen25vl_processor()
    processor.save_pretrained(folder)
    return model, processor


def png(seed: int, width: int, height: int) -> bytes:
    """A PNG of random pixels, as Pillow writes it."""
    from PIL import Image

    pixels = (np.random.default_rng(seed).random((height, width, 3)) * 255).astype("uint8")
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def image_messages(text: str, images: list[bytes]) -> list[dict]:
    """One user message: the pictures as data-URL image parts, then the text."""
    parts = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(i).decode()}}
             for i in images]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]
