"""An image processor's settings for one request (vLLM's `mm_processor_kwargs`, over the gateway's
--mm-processor-kwargs): Qwen2.5-VL's pixel range, Gemma 3's pan and scan; each checked against
what the model's processor takes, a 400 naming any other."""

from __future__ import annotations

import math
from dataclasses import dataclass

import msgspec

from services.api.errors import APIError
from shared.wire.images import PAN_AND_SCAN_KEYS as PAN_AND_SCAN
from shared.wire.images import PIXEL_RANGE_KEYS as PIXEL_RANGE
from shared.wire.images import ImageSpec

PARAM = "mm_processor_kwargs"


@dataclass(frozen=True)
class ProcessorArgs:
    spec: ImageSpec  # the model's, its pixel range as asked
    do_pan_and_scan: bool = False
    pan_and_scan_min_crop_size: int = 256  # Gemma3ImageProcessor's defaults
    pan_and_scan_max_num_crops: int = 4
    pan_and_scan_min_ratio_to_activate: float = 1.2


def processor_args(spec: ImageSpec | None, defaults: dict, asked: dict | None) -> ProcessorArgs | None:
    """The request's settings over the gateway's defaults (those the model's processor takes: one
    gateway may serve models of either kind). A text-only model (spec None) takes none: asked any,
    a 400; else None."""
    if spec is None:
        if asked:
            raise APIError(400, f"{PARAM}: this model takes no images, so no image processor settings",
                           param=PARAM)
        return None
    takes = PIXEL_RANGE if spec.dynamic else PAN_AND_SCAN if spec.pan_and_scan else ()
    for key in asked or {}:
        if key not in takes:
            raise APIError(400, f"{PARAM}: {key!r} is not a setting of this model's image processor (it takes "
                                f"{', '.join(takes) or 'none'}; docs/images.md)", param=PARAM)
    merged = {k: v for k, v in defaults.items() if k in takes} | (asked or {})
    for key, value in merged.items():
        if key == "do_pan_and_scan":
            ok = isinstance(value, bool)
        elif key == "pan_and_scan_min_ratio_to_activate":
            ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value >= 1
        else:
            ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
        if not ok:
            raise APIError(400, f"{PARAM}: {key} cannot be {value!r}", param=PARAM)
    lo, hi = merged.get("min_pixels", spec.min_pixels), merged.get("max_pixels", spec.max_pixels)
    if lo > hi:
        raise APIError(400, f"{PARAM}: min_pixels {lo} is more than max_pixels {hi}", param=PARAM)
    if spec.dynamic and hi < spec.patch * spec.patch:
        raise APIError(400, f"{PARAM}: max_pixels {hi} is less than one image token's {spec.patch}x{spec.patch}",
                       param=PARAM)
    sized = msgspec.structs.replace(spec, min_pixels=lo, max_pixels=hi) if spec.dynamic else spec
    return ProcessorArgs(sized, **{k: v for k, v in merged.items() if k in PAN_AND_SCAN})


def pan_and_scan(width: int, height: int, args: ProcessorArgs) -> list[tuple[int, int, int, int]]:
    """Gemma 3's crops of a long image (left, top, right, bottom), as its image processor cuts them:
    none unless asked and the image is at least min_ratio_to_activate times longer than wide (or
    wider), then 2 to max_num_crops of about its aspect ratio, each at least min_crop_size."""
    if not args.do_pan_and_scan:
        return []
    long, short = max(width, height), min(width, height)
    if long / short < args.pan_and_scan_min_ratio_to_activate:
        return []
    num = min(int(math.floor(long / short + 0.5)), int(math.floor(long / args.pan_and_scan_min_crop_size)))
    num = min(args.pan_and_scan_max_num_crops, max(2, num))
    across, down = (num, 1) if width >= height else (1, num)
    crop_w, crop_h = math.ceil(width / across), math.ceil(height / down)
    if min(crop_w, crop_h) < args.pan_and_scan_min_crop_size:
        return []
    return [(left, top, min(left + crop_w, width), min(top + crop_h, height))
            for top in range(0, crop_h * down, crop_h) for left in range(0, crop_w * across, crop_w)]
