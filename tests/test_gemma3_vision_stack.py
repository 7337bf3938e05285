"""Images through the whole stack, on `make run`'s defaults: a random Gemma3ForConditionalGeneration
(shrunk: 16x16 images of 4 tokens, 2 layers; say so) with SmolLM2's tokenizer and Gemma 3's image
tokens added, served by the services and called with the official openai client. Greedy tokens
equal transformers' generate over the processor's inputs for one image, two images and text only;
the prefix cache shares the blocks of the same image and never those of another."""

from __future__ import annotations

import base64
import copy
import io

import numpy as np
import pytest
import torch
from PIL import Image

from bench.images import (
    GEMMA3_TEMPLATE,  # Gemma 3's chat template, its image and text parts as the Hub's writes them
)
from tests.image_checkpoints import image_messages, png
from tests.model_helpers import answer_logprobs, generate_with_logprobs, serve_checkpoint

pytestmark = pytest.mark.stack
transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")
TOKENS_PER_IMAGE, SIDE = 4, 16



@pytest.fixture(scope="module")
def served(tmp_path_factory, hf_tokenizer):
    tokenizer = copy.deepcopy(hf_tokenizer)  # the session's is SmolLM2's as it is
    tokenizer.add_special_tokens({"additional_special_tokens": ["<start_of_image>", "<end_of_image>",
                                                                "<image_soft_token>"]})
    tokenizer.chat_template = GEMMA3_TEMPLATE
    boi, eoi, image = tokenizer.convert_tokens_to_ids(["<start_of_image>", "<end_of_image>", "<image_soft_token>"])
    torch.manual_seed(0)
    config = transformers.Gemma3Config(
        text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=len(tokenizer), sliding_window=16,
                         layer_types=["sliding_attention", "full_attention"], max_position_embeddings=1024,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           patch_size=4, image_size=SIDE, vision_use_head=False),
        mm_tokens_per_image=TOKENS_PER_IMAGE, image_token_index=image, boi_token_index=boi, eoi_token_index=eoi)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    stack = serve_checkpoint(tmp_path_factory, "gemma3-vision", model, tokenizer, "--max-model-len", "512")
    yield stack, model, tokenizer
    stack.stop()


def picture(seed: int, width: int = 31, height: int = 23) -> bytes:
    return png(seed, width, height)


def _expected(model, tokenizer, text: str, images: list[bytes], num_tokens: int, pan_and_scan: dict | None = None
              ) -> tuple[list[int], list[int], list[float]]:
    """What Gemma 3's processor and transformers' generate make of the request: (prompt ids, tokens,
    each token's logprob). pan_and_scan: its processor's pan-and-scan settings (Gemma3Processor's
    sentence around an image's run and its crops')."""
    content = [*({"type": "image"} for _ in images), {"type": "text", "text": text}]
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                           add_generation_prompt=True)
    run = "\n\n<start_of_image>" + "<image_soft_token>" * TOKENS_PER_IMAGE + "<end_of_image>\n\n"
    kwargs, crops = {}, [0] * len(images)
    if images:
        from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

        defaults = {"pan_and_scan_min_crop_size": 256, "pan_and_scan_max_num_crops": 4,
                    "pan_and_scan_min_ratio_to_activate": 1.2}  # its processor's
        processor = Gemma3ImageProcessorPil(size={"height": SIDE, "width": SIDE},
                                            **(defaults | pan_and_scan if pan_and_scan else {}))
        out = processor(images=[Image.open(io.BytesIO(i)) for i in images], return_tensors="pt")
        kwargs["pixel_values"], crops = out["pixel_values"], [int(n) for n in out["num_crops"]]
    pieces = prompt.split("<start_of_image>")
    prompt = pieces[0] + "".join(
        (run if n == 0 else f"Here is the original image {run} and here are some crops to help you see better "
         + " ".join([run] * n)) + piece for n, piece in zip(crops, pieces[1:], strict=True))
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    input_ids = torch.tensor([ids])
    if images:
        kwargs["token_type_ids"] = (input_ids == model.config.image_token_index).long()
    tokens, logprobs = generate_with_logprobs(model, ids, num_tokens, **kwargs)
    return ids, tokens, logprobs


@pytest.mark.parametrize("num_images", [1, 2, 0])
def test_greedy_tokens_equal_transformers_generate(served, num_images):
    stack, model, tokenizer = served
    client = openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused")
    images = [picture(seed) for seed in range(num_images)]
    got = client.chat.completions.create(model="gemma3-vision", messages=image_messages("What is this?", images),
                                         max_tokens=8, temperature=0, logprobs=True,
                                         extra_body={"ignore_eos": True, "return_token_ids": True})
    prompt_ids, tokens, logprobs = _expected(model, tokenizer, "What is this?", images, 8)
    assert got.model_extra["prompt_token_ids"] == prompt_ids
    assert got.choices[0].model_extra["token_ids"] == tokens
    assert np.allclose(answer_logprobs(got), logprobs, atol=1e-3, rtol=0)  # the images' features and attention count
    assert got.usage.prompt_tokens == len(prompt_ids)  # the image tokens count


def test_the_prefix_cache_shares_an_image_and_never_another(served):
    """A long text after the image, so that whole blocks follow it: the same image again hits them;
    another image with the same text misses from the image's block on, and answers as it would alone."""
    stack, model, tokenizer = served
    client = openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused")
    text = "Describe the picture in great detail, please, " * 6

    def ask(seed: int):
        return client.chat.completions.create(model="gemma3-vision", messages=image_messages(text, [picture(seed)]),
                                              max_tokens=6, temperature=0, logprobs=True,
                                              extra_body={"ignore_eos": True, "return_token_ids": True})
    first, again, other = ask(10), ask(10), ask(11)
    cached = [r.usage.prompt_tokens_details.cached_tokens if r.usage.prompt_tokens_details else 0
              for r in (first, again, other)]
    assert cached[1] >= 32 and cached[2] < cached[1]  # the same image: its blocks and the text's after them
    _, tokens, logprobs = _expected(model, tokenizer, text, [picture(11)], 6)
    assert other.choices[0].model_extra["token_ids"] == tokens
    assert np.allclose(answer_logprobs(other), logprobs, atol=1e-3, rtol=0)
    assert np.allclose(answer_logprobs(again), answer_logprobs(first), atol=1e-5, rtol=0)  # its image's blocks from the cache
    assert not np.allclose(answer_logprobs(other), answer_logprobs(first), atol=1e-3, rtol=0)


@pytest.mark.parametrize(("content", "why"), [
    ({"url": "data:image/png;base64," + base64.b64encode(b"not a picture").decode()},
     "image 0: the data is not an image"),
    ({"url": "http://127.0.0.1:9/cat.png"}, "image 0: the image URL's host '127.0.0.1' is a private address"),
    ({"url": "file:///etc/passwd"}, "image 0: an image URL's scheme must be http, https or data"),
])
def test_an_image_that_cannot_be_used_is_a_400_naming_it(served, content, why):
    stack, _, _ = served
    client = openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": content}]}]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="gemma3-vision", messages=messages, max_tokens=2)
    assert why in err.value.message


def test_images_past_the_context_are_a_400(served):
    stack, _, _ = served
    client = openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as err:  # 100 images of 8 tokens with their markers: past 512
        client.chat.completions.create(model="gemma3-vision", messages=image_messages("Hi", [picture(0)] * 100),
                                       max_tokens=2)
    assert "512" in err.value.message


def test_pan_and_scan_crops_follow_the_image_as_gemma3s_processor_lays_them_out(served):
    """mm_processor_kwargs' do_pan_and_scan on a picture three times wider than tall: the image and
    its three crops, each its own run of image tokens in Gemma3Processor's sentence, as transformers
    generates over the processor's four images."""
    stack, model, tokenizer = served
    client = openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused")
    settings = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 8}
    wide = picture(5, width=60, height=20)
    got = client.chat.completions.create(model="gemma3-vision", messages=image_messages("What is this?", [wide]),
                                         max_tokens=6, temperature=0, logprobs=True,
                                         extra_body={"ignore_eos": True, "return_token_ids": True,
                                                     "mm_processor_kwargs": settings})
    prompt_ids, tokens, logprobs = _expected(model, tokenizer, "What is this?", [wide], 6, settings)
    assert got.model_extra["prompt_token_ids"] == prompt_ids
    assert prompt_ids.count(model.config.image_token_index) == 4 * TOKENS_PER_IMAGE
    assert got.choices[0].model_extra["token_ids"] == tokens
    assert np.allclose(answer_logprobs(got), logprobs, atol=1e-3, rtol=0)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="gemma3-vision", messages=image_messages("Hi", [wide]), max_tokens=2,
                                       extra_body={"mm_processor_kwargs": {"max_pixels": 1000}})
    assert "'max_pixels' is not a setting of this model's image processor" in err.value.message
