"""Images in the scheduler, without a model: no prompt chunk ends inside an image, an image's key
joins the hashes of the blocks it touches, and a Submit's images are checked before admission."""

from __future__ import annotations

import msgspec
import pytest

from services.scheduler.kv_cache_manager import KVCacheManager
from services.scheduler.request import Request
from services.scheduler.scheduler import Scheduler
from services.scheduler.validate import images_error
from shared.wire.hashing import hash_block_chain, root_hash
from shared.wire.images import ImageRef, ImageSpec
from shared.wire.messages import SamplingParams, Submit
from tests.test_scheduler import run_step

IMAGE = 99
SPEC = ImageSpec(size=16, num_tokens=6, token_id=IMAGE, start_id=97, end_id=98)
# each image at its own size (Qwen2.5-VL's kind): one token per 8x8 pixels, at most 64x64 pixels
DYNAMIC = ImageSpec(size=0, num_tokens=0, token_id=IMAGE, start_id=97, end_id=98, patch=8, min_pixels=64,
                    max_pixels=64 * 64, resample="bicubic")
ROOT = root_hash("m", "auto")


def image_request(request_id: str, layout: list[int | str], key: str = "k") -> Request:
    """layout: text lengths and "img" for an image of SPEC's tokens (with its start and end tokens)."""
    ids, images = [], []
    for part in layout:
        if part == "img":
            ids.append(SPEC.start_id)
            images.append(ImageRef(key=f"{key}{len(images)}", offset=len(ids), num_tokens=SPEC.num_tokens))
            ids += [IMAGE] * SPEC.num_tokens + [SPEC.end_id]
        else:
            ids += list(range(1, part + 1))
    return Request(request_id, ids, SamplingParams(max_tokens=2), reply_to="r", images=images)


@pytest.mark.parametrize(("layout", "budget", "chunks"), [
    ([3, "img", 2], 8, [4, 8, 1]),  # cut back to the image's start, then the image whole and the rest
    (["img", 10], 6, [1, 6, 6, 5]),  # a chunk starting at an image runs to its end
    ([5, "img", "img", 1], 9, [6, 8, 8]),  # two images: each whole
])
def test_no_prompt_chunk_ends_inside_an_image(layout, budget, chunks):
    s = Scheduler(KVCacheManager(64, 4, ROOT), 4, budget)
    request = image_request("a", layout)
    s.add_request(request)
    got = []
    while request.num_computed_tokens < request.num_prompt_tokens:
        start = request.num_computed_tokens
        plan, _ = run_step(s)
        end = start + plan.num_new_tokens["a"]
        assert not any(image.offset < end < image.end for image in request.images)
        got.append(end - start)
    assert got == chunks


def test_an_image_larger_than_what_is_left_of_the_step_waits_for_the_next():
    s = Scheduler(KVCacheManager(64, 4, ROOT), 4, 8, long_prefill_token_threshold=4)
    s.add_request(image_request("a", [3, "img"], key="a"))
    s.add_request(image_request("b", [3, "img"], key="b"))
    # a cut back to its image; b hits a's first block (the same text) and its image does not fit in the 4 left
    assert run_step(s)[0].num_new_tokens == {"a": 4}
    assert run_step(s)[0].num_new_tokens == {"a": 6}  # a's image whole, past the share of 4; b's not in the 2 left
    assert run_step(s)[0].num_new_tokens == {"a": 1, "b": 7}  # the rest of b's prompt, its image whole


def test_an_images_key_joins_the_hashes_of_the_blocks_it_touches():
    a, b = image_request("a", [5, "img", 8], key="a"), image_request("b", [5, "img", 8], key="b")
    assert a.prompt_token_ids == b.prompt_token_ids
    hashes = [hash_block_chain(ROOT, r.prompt_token_ids, 4, images=[(i.offset, i.end, i.key) for i in r.images])
              for r in (a, b)]
    plain = hash_block_chain(ROOT, a.prompt_token_ids, 4)
    assert hashes[0][0] == hashes[1][0] == plain[0]  # the text before the image
    assert all(x != y for x, y in zip(hashes[0][1:], hashes[1][1:], strict=True))  # from its first block on
    assert hashes[0] == hash_block_chain(ROOT, a.prompt_token_ids, 4, images=[(6, 12, "a0")])


@pytest.mark.parametrize(("images", "spec", "why"), [
    ([ImageRef("k", 1, 6)], None, "this model takes no images"),
    ([ImageRef("k", 1, 5)], SPEC, "must be 16x16 pixels of 6 tokens"),
    ([ImageRef("k", 1, 6, 25, 16)], DYNAMIC, "the sides must be multiples of 8"),
    ([ImageRef("k", 1, 6, 16, 16)], DYNAMIC, "16x16 pixels take 4 tokens, not 6"),
    ([ImageRef("k", 0, 6)], SPEC, "are not all image tokens"),
    ([ImageRef("k", 1, 6), ImageRef("j", 3, 6)], SPEC, "after the image before it"),
    ([ImageRef("", 1, 6)], SPEC, "key must be 1 to 256 characters"),
])
def test_a_submits_images_are_checked(images, spec, why):
    prompt = [SPEC.start_id] + [IMAGE] * 6 + [SPEC.end_id, 5]
    submit = Submit(request_id="r", model="m", prompt_token_ids=prompt, sampling=SamplingParams(), reply_to="x",
                    arrival_time=0.0, images=images)
    assert why in images_error(submit, spec, 512)
    good = Submit(request_id="r", model="m", prompt_token_ids=prompt, sampling=SamplingParams(), reply_to="x",
                  arrival_time=0.0, images=[ImageRef("k", 1, 6)])
    assert images_error(good, SPEC, 512) is None
    sized = msgspec.structs.replace(good, images=[ImageRef("k", 1, 6, 24, 16)])
    assert images_error(sized, DYNAMIC, 512) is None
    assert "more than one step computes" in images_error(good, SPEC, 4)


@pytest.mark.parametrize("size", [(40, 24), (1000, 30), (7, 9), (3000, 2000), (29, 5000)])
def test_an_image_is_resized_as_qwen2_vls_processor_does(size):
    """ImageSpec.resized against transformers' smart_resize (the processor the gateway follows)."""
    vl = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
    spec = msgspec.structs.replace(DYNAMIC, patch=28, min_pixels=56 * 56, max_pixels=28 * 28 * 1280)
    width, height = size
    h, w = vl.smart_resize(height, width, factor=28, min_pixels=56 * 56, max_pixels=28 * 28 * 1280)
    assert spec.resized(width, height) == (w, h)
    assert spec.tokens_for(w, h) == (w // 28) * (h // 28)


def test_an_image_far_longer_than_wide_is_refused():
    with pytest.raises(ValueError, match="may differ by at most 200 times"):
        DYNAMIC.resized(10, 2001)
