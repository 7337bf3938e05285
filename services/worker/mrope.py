"""M-RoPE's positions (Qwen2.5-VL): a token's time, row and column. A text token's three are its
index plus the shift of the images before it; an image's tokens share a time and count rows and
columns from where the image starts; the text after an image starts past its longer side."""

from __future__ import annotations

import torch

from services.worker.backends.base import BatchRow
from shared.wire.images import ImageRef


def mrope_positions(batch: list[BatchRow], token_pixels: int) -> torch.Tensor | None:
    """The batch's positions as [3, T] (transformers' get_rope_index, then its rope deltas for the
    tokens after the prompt), or None where no row's sequence has an image (each token's three are
    its index: the plain positions stand). token_pixels: pixels a side of one image token. A step
    of text tokens alone (every decode step) gets [T]: its three are equal, each index plus its
    shift, and a plain rotary turns them the same (so a CUDA graph's one-row positions take them)."""
    if not any(seq.images for seq, _ in batch):
        return None
    parts = []
    for seq, num_new in batch:
        index = torch.arange(seq.num_computed_tokens, seq.num_computed_tokens + num_new)
        if seq.images and seq.num_computed_tokens < seq.images[-1].end:  # a row in or before its images
            parts.append(_axes(seq.images, index, token_pixels))
        else:  # text after every image (each decode step): its index plus the images' whole shift
            parts.append((index + _shift(seq.images, token_pixels)).expand(3, -1))
    out = torch.cat(parts, dim=1)
    return out[0].contiguous() if torch.equal(out[0], out[1]) and torch.equal(out[1], out[2]) else out


def _shift(images: list[ImageRef], token_pixels: int) -> int:
    """How far the images move the text after them: each by its longer side less its tokens."""
    return sum(max(i.height, i.width) // token_pixels - i.num_tokens for i in images)


def _axes(images: list[ImageRef], index: torch.Tensor, token_pixels: int) -> torch.Tensor:
    out = index.expand(3, -1).clone()
    shift = 0  # the images before so far: each moves the text after it by (its longer side - its tokens)
    for image in images:
        cols = image.width // token_pixels
        inside = (index >= image.offset) & (index < image.end)
        if inside.any():
            k = index[inside] - image.offset
            first = image.offset + shift
            out[0, inside] = first
            out[1, inside] = first + k // cols
            out[2, inside] = first + k % cols
        delta = _shift([image], token_pixels)
        out[:, index >= image.end] += delta
        shift += delta
    return out
