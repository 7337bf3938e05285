"""Qwen2.5-VL images through the whole stack, on `make run`'s defaults: a random
Qwen2_5_VLForConditionalGeneration (shrunk: 4-pixel patches, so one token per 8x8 pixels, 2 layers
each tower; say so) with SmolLM2's tokenizer and Qwen's vision tokens added, served by the services
and called with the official openai client. Each picture keeps about its own size (12 and 24 tokens
here); greedy tokens equal transformers' generate over its own processor's inputs for one image, two
images and text only; the prefix cache shares the same image and never another."""

from __future__ import annotations

import copy
import io

import numpy as np
import pytest
import torch
from PIL import Image

from bench.images import QWEN25VL_TEMPLATE  # Qwen2.5-VL's chat template as the Hub's writes it
from tests.image_checkpoints import image_messages, png, qwen25vl, qwen25vl_config, qwen25vl_processor
from tests.model_helpers import answer_logprobs, generate_with_logprobs, serve_checkpoint

pytestmark = pytest.mark.stack
transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")
SIZES = [(31, 23), (50, 30)]  # (width, height) -> 32x24 and 48x32 pixels: 4x3 and 6x4 tokens
NAME = "qwen25vl"


@pytest.fixture(scope="module")
def served(tmp_path_factory, hf_tokenizer):
    tokenizer = copy.deepcopy(hf_tokenizer)  # the session's is SmolLM2's as it is
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]})
    tokenizer.chat_template = QWEN25VL_TEMPLATE
    start, end, image = tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>", "<|image_pad|>"])
    model, processor = qwen25vl(tmp_path_factory.mktemp("qwen25vl-weights"), qwen25vl_config(
        len(tokenizer), image, start, end, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id))
    stack = serve_checkpoint(tmp_path_factory, NAME, model, tokenizer, "--max-model-len", "512", processor=processor)
    yield stack, model, tokenizer
    stack.stop()


def picture(seed: int, size: tuple[int, int] = SIZES[0]) -> bytes:
    return png(seed, *size)


def _expected(model, tokenizer, text: str, images: list[bytes], num_tokens: int, pixels: dict | None = None
              ) -> tuple[list[int], list[int], list[float]]:
    """What Qwen2.5-VL's processor (with `pixels`: its min_pixels, max_pixels) and transformers'
    generate make of the request: (prompt ids, tokens, each token's logprob)."""
    content = [*({"type": "image"} for _ in images), {"type": "text", "text": text}]
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                           add_generation_prompt=True)
    kwargs = {}
    if images:
        inputs = qwen25vl_processor(**(pixels or {}))([Image.open(io.BytesIO(i)).convert("RGB") for i in images], return_tensors="pt")
        counts = (inputs["image_grid_thw"].prod(-1) // 4).tolist()
        parts = prompt.split("<|image_pad|>")
        prompt = parts[0] + "".join("<|image_pad|>" * n + part for n, part in zip(counts, parts[1:], strict=True))
        kwargs = {"pixel_values": inputs["pixel_values"], "image_grid_thw": inputs["image_grid_thw"]}
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    input_ids = torch.tensor([ids])
    if images:
        kwargs["mm_token_type_ids"] = (input_ids == model.config.image_token_id).int()
    tokens, logprobs = generate_with_logprobs(model, ids, num_tokens, **kwargs)
    return ids, tokens, logprobs


def _ask(client, text: str, images: list[bytes], max_tokens: int = 8, pixels: dict | None = None):
    extra = {"ignore_eos": True, "return_token_ids": True} | ({"mm_processor_kwargs": pixels} if pixels else {})
    return client.chat.completions.create(model=NAME, messages=image_messages(text, images), max_tokens=max_tokens,
                                          temperature=0, logprobs=True, extra_body=extra)


@pytest.mark.parametrize("num_images", [1, 2, 0])
def test_greedy_tokens_equal_transformers_generate(served, num_images):
    stack, model, tokenizer = served
    client = openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused")
    images = [picture(seed, size) for seed, size in zip(range(num_images), SIZES, strict=False)]
    got = _ask(client, "What is this?", images)
    prompt_ids, tokens, logprobs = _expected(model, tokenizer, "What is this?", images, 8)
    assert got.model_extra["prompt_token_ids"] == prompt_ids  # each image's run as long as its size makes it
    assert got.choices[0].model_extra["token_ids"] == tokens
    assert np.allclose(answer_logprobs(got), logprobs, atol=1e-3, rtol=0)  # the features and M-RoPE's positions count
    assert got.usage.prompt_tokens == len(prompt_ids)


def test_the_prefix_cache_shares_an_image_and_never_another(served):
    stack, model, tokenizer = served
    client = openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused")
    text = "Describe the picture in great detail, please, " * 6
    first, again, other = (_ask(client, text, [picture(seed)], 6) for seed in (10, 10, 11))
    cached = [r.usage.prompt_tokens_details.cached_tokens if r.usage.prompt_tokens_details else 0
              for r in (first, again, other)]
    assert cached[1] >= 32 and cached[2] < cached[1]
    _, tokens, logprobs = _expected(model, tokenizer, text, [picture(11)], 6)
    assert other.choices[0].model_extra["token_ids"] == tokens
    assert np.allclose(answer_logprobs(other), logprobs, atol=1e-3, rtol=0)
    assert np.allclose(answer_logprobs(again), answer_logprobs(first), atol=1e-5, rtol=0)


def test_tokenize_counts_each_images_own_tokens(served):
    stack, model, tokenizer = served
    import httpx

    images = [picture(0, SIZES[0]), picture(1, SIZES[1])]
    got = httpx.post(stack.base_url + "/tokenize", json={"model": NAME, "messages": image_messages("Hi", images),
                                                         "add_generation_prompt": True}, timeout=60).json()
    assert got["tokens"] == _expected(model, tokenizer, "Hi", images, 1)[0]
    assert got["tokens"].count(model.config.image_token_id) == 12 + 24


def test_an_image_far_longer_than_wide_is_a_400(served):
    stack, _, _ = served
    client = openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=NAME, messages=image_messages("Hi", [picture(0, (1, 300))]), max_tokens=2)
    assert "image 0: the image is 1x300: its sides may differ by at most 200 times" in err.value.message


def test_a_requests_pixel_range_resizes_its_images_as_the_processor_would(served):
    """mm_processor_kwargs' max_pixels below the picture's 48x32: scaled down to 32x16 (8 tokens),
    as Qwen2-VL's processor with that range."""
    stack, model, tokenizer = served
    client = openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused")
    small = {"max_pixels": 32 * 24}
    images = [picture(7, SIZES[1])]
    got = _ask(client, "What is this?", images, pixels=small)
    prompt_ids, tokens, logprobs = _expected(model, tokenizer, "What is this?", images, 8, small)
    assert prompt_ids.count(model.config.image_token_id) == 8
    assert got.model_extra["prompt_token_ids"] == prompt_ids
    assert got.choices[0].model_extra["token_ids"] == tokens
    assert np.allclose(answer_logprobs(got), logprobs, atol=1e-3, rtol=0)
