"""An image-text model's images on the worker: pixels fetched from the media store before a step,
features encoded once per image (a step's new images in one batch) and kept within a bound, and
what a step's prefill rows take from them (their image tokens' features, the spans seen both ways)."""

from __future__ import annotations

from collections import OrderedDict

import torch

from services.worker.backends.base import BatchRow
from services.worker.vision_config import QwenVisionConfig, VisionConfig
from shared.wire.images import ImageRef, ImageSpec

FEATURES_BYTES = 256 * 2**20  # encoded images kept (Gemma 3 4B's: 256 tokens x 2,560 x 4 bytes = 2.6 MB each)
MAX_PENDING = 64  # images fetched and not yet encoded (a step's new ones)


def image_spec(config: VisionConfig | QwenVisionConfig) -> ImageSpec:
    """What the gateway and the scheduler are told of the model's images (its workers' hello)."""
    if isinstance(config, QwenVisionConfig):
        return ImageSpec(size=0, num_tokens=0, token_id=config.image_token_id, start_id=config.start_token_id,
                         end_id=config.end_token_id, patch=config.token_pixels, min_pixels=config.min_pixels,
                         max_pixels=config.max_pixels, resample="bicubic")
    return ImageSpec(size=config.image_size, num_tokens=config.mm_tokens_per_image, token_id=config.image_token_id,
                     start_id=config.start_token_id, end_id=config.end_token_id, pan_and_scan=True)


class ImageCache:
    def __init__(self, tower: torch.nn.Module, config: VisionConfig | QwenVisionConfig,
                 max_bytes: int = FEATURES_BYTES):
        """tower: the model's image encoder; its encode() takes RGB uint8 [height, width, 3] images."""
        self.tower, self.max_bytes = tower, max_bytes
        self.spec = image_spec(config)
        self.pixels: dict[str, torch.Tensor] = {}  # fetched, not encoded yet
        self.features: OrderedDict[str, torch.Tensor] = OrderedDict()  # least recently used first
        self.num_encoded = 0

    def missing(self, images: list[ImageRef]) -> list[ImageRef]:
        """Images whose pixels must be fetched before a step can run them."""
        return [i for i in images if i.key not in self.features and i.key not in self.pixels]

    def add_pixels(self, image: ImageRef, data: bytes) -> None:
        spec = self.spec
        width, height = (image.width, image.height) if spec.dynamic else (spec.size, spec.size)
        if len(data) != width * height * 3:
            raise ValueError(f"image {image.key}: {len(data)} bytes are not {width}x{height} RGB pixels")
        self.pixels[image.key] = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(height, width, 3)
        while len(self.pixels) > MAX_PENDING:  # fetched for rows that never ran (aborted, failed): the oldest go
            self.pixels.pop(next(iter(self.pixels)))

    def unavailable(self, images: list[ImageRef]) -> str | None:
        """Why a new sequence cannot run (an image neither encoded nor fetched), or None."""
        gone = self.missing(images)
        return f"image {gone[0].key} is not in the media store (expired, or never stored)" if gone else None

    def step_inputs(self, batch: list[BatchRow]) -> tuple[tuple[torch.Tensor, torch.Tensor] | None,
                                                           dict[int, list[tuple[int, int]]]]:
        """(rows of the flattened batch that are image tokens, their features) and each prefill's
        image spans (keyed by its first row), for the rows of this step."""
        needed = [i for seq, num_new in batch for i in seq.images
                  if i.offset < seq.num_computed_tokens + num_new and i.end > seq.num_computed_tokens]
        new = [i.key for i in needed if i.key not in self.features]
        self._encode(new)
        rows, features, spans, row = [], [], {}, 0
        for seq, num_new in batch:
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new
            touched = [i for i in seq.images if i.offset < end and i.end > start]
            if touched:
                spans[row] = [(i.offset, i.end) for i in touched]
            for image in touched:
                first, last = max(image.offset, start), min(image.end, end)
                rows.extend(range(row + first - start, row + last - start))
                features.append(self.features[image.key][first - image.offset:last - image.offset])
                self.features.move_to_end(image.key)
            row += num_new
        if new:  # the cache only grows by a step's new images
            self._evict(keep={i.key for i in needed})
        if not rows:
            return None, spans
        return (torch.tensor(rows, dtype=torch.long), torch.cat(features)), spans

    def _encode(self, keys: list[str]) -> None:
        keys = list(dict.fromkeys(keys))
        if not keys:
            return
        with torch.inference_mode():
            encoded = self.tower.encode([self.pixels.pop(k) for k in keys])
        for key, features in zip(keys, encoded, strict=True):
            self.features[key] = features
        self.num_encoded += len(keys)

    def _evict(self, keep: set[str]) -> None:
        """The least recently used first, past max_bytes; never one this step reads."""
        size = sum(f.nbytes for f in self.features.values())
        for key in [k for k in self.features if k not in keep]:
            if size <= self.max_bytes:
                return
            size -= self.features.pop(key).nbytes
