"""The image processors' settings at the gateway (media/processor.py): Gemma 3's pan and scan cuts
the crops transformers' Gemma3ImageProcessorPil cuts; mm_processor_kwargs are checked against what
the model's processor takes, over the gateway's --mm-processor-kwargs."""

from __future__ import annotations

import numpy as np
import pytest

from services.api.errors import APIError
from services.api.media.processor import pan_and_scan, processor_args
from shared.wire.images import ImageSpec

GEMMA = ImageSpec(size=896, num_tokens=256, token_id=9, start_id=7, end_id=8, pan_and_scan=True)
QWEN = ImageSpec(size=0, num_tokens=0, token_id=9, start_id=7, end_id=8, patch=28, min_pixels=3136,
                 max_pixels=1003520, resample="bicubic")


@pytest.mark.parametrize(("width", "height", "kwargs"), [
    (1000, 300, {}), (300, 1000, {}), (1001, 500, {}), (700, 600, {}), (2000, 200, {}),
    (1000, 300, {"pan_and_scan_max_num_crops": 2}), (1000, 300, {"pan_and_scan_min_crop_size": 400}),
    (900, 500, {"pan_and_scan_min_ratio_to_activate": 2.0}), (5000, 900, {"pan_and_scan_max_num_crops": 8}),
])
def test_pan_and_scan_cuts_gemma3s_processors_crops(width, height, kwargs):
    gemma3 = pytest.importorskip("transformers.models.gemma3.image_processing_pil_gemma3")
    defaults = {"pan_and_scan_min_crop_size": 256, "pan_and_scan_max_num_crops": 4,
                "pan_and_scan_min_ratio_to_activate": 1.2}
    image = np.arange(height * width, dtype=np.int64).reshape(1, height, width)  # each pixel its own number
    want = gemma3.Gemma3ImageProcessorPil().pan_and_scan(image, **(defaults | kwargs))
    args = processor_args(GEMMA, {}, {"do_pan_and_scan": True, **kwargs})
    got = [image[:, top:bottom, left:right] for left, top, right, bottom in pan_and_scan(width, height, args)]
    assert len(got) == len(want) and all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))


def test_no_crops_unless_asked():
    assert pan_and_scan(1000, 300, processor_args(GEMMA, {}, None)) == []
    assert len(pan_and_scan(1000, 300, processor_args(GEMMA, {"do_pan_and_scan": True}, None))) == 3  # the gateway's


def test_a_requests_pixel_range_over_the_gateways():
    args = processor_args(QWEN, {"max_pixels": 200_000, "do_pan_and_scan": True}, {"min_pixels": 100_000})
    assert (args.spec.min_pixels, args.spec.max_pixels) == (100_000, 200_000)  # Gemma's key left for Gemma
    assert args.spec.resized(64, 64) == (336, 336)  # scaled up into the range, as smart_resize does


@pytest.mark.parametrize(("spec", "kwargs", "why"), [
    (QWEN, {"do_pan_and_scan": True}, "'do_pan_and_scan' is not a setting of this model's image processor "
                                      "(it takes min_pixels, max_pixels"),
    (GEMMA, {"max_pixels": 10}, "'max_pixels' is not a setting"),
    (QWEN, {"min_pixels": 5000, "max_pixels": 4000}, "min_pixels 5000 is more than max_pixels 4000"),
    (QWEN, {"min_pixels": 10, "max_pixels": 100}, "max_pixels 100 is less than one image token's 28x28"),
    (QWEN, {"max_pixels": "big"}, "max_pixels cannot be 'big'"),
    (GEMMA, {"do_pan_and_scan": 1}, "do_pan_and_scan cannot be 1"),
    (GEMMA, {"pan_and_scan_min_ratio_to_activate": 0.5}, "pan_and_scan_min_ratio_to_activate cannot be 0.5"),
])
def test_a_setting_the_processor_does_not_take_is_a_400(spec, kwargs, why):
    with pytest.raises(APIError) as err:
        processor_args(spec, {}, kwargs)
    assert err.value.status == 400 and why in err.value.message


def test_a_text_only_model_refuses_image_processor_settings_and_the_gateway_a_misspelt_one():
    import argparse

    from shared.gateway_config import add_api_args

    assert processor_args(None, {"max_pixels": 10_000}, None) is None  # the gateway's: for the models that take them
    with pytest.raises(APIError, match="this model takes no images, so no image processor settings"):
        processor_args(None, {}, {"max_pixels": 10_000})
    parser = argparse.ArgumentParser()
    add_api_args(parser)
    assert parser.parse_args(["--mm-processor-kwargs", '{"max_pixels": 1000}']).mm_processor_kwargs == {"max_pixels": 1000}
    with pytest.raises(SystemExit):
        parser.parse_args(["--mm-processor-kwargs", '{"max_pixel": 1000}'])
