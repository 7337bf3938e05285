"""Images on the wire: what an image-text model takes (ImageSpec, in a worker's hello), and where a
prompt's images are (ImageRef, on a Submit and a NewSeq; their pixels in shared/bus/media.py's store)."""

from __future__ import annotations

import math

import msgspec

MAX_ASPECT = 200  # Qwen2.5-VL's processor refuses an image longer than this many times its width, or wider
# the image processors' settings a request (or the gateway) may give (vLLM's mm_processor_kwargs):
# Qwen2-VL's pixel range, Gemma 3's pan and scan
PIXEL_RANGE_KEYS = ("min_pixels", "max_pixels")
PAN_AND_SCAN_KEYS = ("do_pan_and_scan", "pan_and_scan_min_crop_size", "pan_and_scan_max_num_crops",
                     "pan_and_scan_min_ratio_to_activate")


class ImageSpec(msgspec.Struct, frozen=True):
    """What an image-text model makes of an image (its workers announce it): the size its vision
    tower reads, the image tokens each image takes in the prompt, and their ids.

    Two kinds: a fixed square (Gemma 3: `size` pixels a side, `num_tokens` each), or each image at
    about its own size (Qwen2.5-VL: `patch` > 0; its sides rounded to multiples of `patch`, its area
    kept within [min_pixels, max_pixels], one token per patch x patch pixels)."""

    size: int  # pixels a side of the square; 0: each image at its own size
    num_tokens: int  # each image's; 0: by its size (tokens_for)
    token_id: int  # each image token's (the features take its place)
    start_id: int  # the tokens that open and close an image's run
    end_id: int
    patch: int = 0  # pixels a side of one image token (Qwen2.5-VL: 14 x its merge of 2 = 28); 0: the square
    min_pixels: int = 0
    max_pixels: int = 0
    resample: str = "bilinear"  # how the gateway resizes: as the model's processor does ("bilinear", "bicubic")
    pan_and_scan: bool = False  # its processor can add crops of a long image, each an image (Gemma 3's)

    @property
    def dynamic(self) -> bool:
        return self.patch > 0

    def resized(self, width: int, height: int) -> tuple[int, int]:
        """The (width, height) an image of this size is resized to (transformers' smart_resize for
        Qwen2-VL's processor: nearest multiples of `patch`, scaled into the pixel range)."""
        if not self.dynamic:
            return self.size, self.size
        if max(width, height) > MAX_ASPECT * min(width, height):
            raise ValueError(f"the image is {width}x{height}: its sides may differ by at most {MAX_ASPECT} times")
        f = self.patch
        h, w = round(height / f) * f, round(width / f) * f
        if h * w > self.max_pixels:
            beta = math.sqrt(height * width / self.max_pixels)
            h, w = max(f, math.floor(height / beta / f) * f), max(f, math.floor(width / beta / f) * f)
        elif h * w < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h, w = math.ceil(height * beta / f) * f, math.ceil(width * beta / f) * f
        return w, h

    def tokens_for(self, width: int, height: int) -> int:
        """Image tokens of an image resized to width x height."""
        return (width // self.patch) * (height // self.patch) if self.dynamic else self.num_tokens


class ImageRef(msgspec.Struct, frozen=True, array_like=True):
    """An image in a request's prompt: its pixels in the media store under `key` (shared/bus/media.py:
    the file's sha256 and the size it was resized to), its tokens at [offset, offset + num_tokens),
    the size in pixels it was resized to (0 x 0: the model's square)."""

    key: str
    offset: int
    num_tokens: int
    width: int = 0
    height: int = 0

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens
