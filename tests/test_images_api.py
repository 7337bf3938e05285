"""Image parts on the OpenAI routes, through the official client, against `make run`'s text-only
model: each a clear 400 before any worker sees it (the limit first, then the model's capability)."""

from __future__ import annotations

import base64
import io

import httpx
import pytest
from PIL import Image

pytestmark = pytest.mark.stack
openai = pytest.importorskip("openai")


def _png_url() -> str:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 30, 30)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _messages(num_images: int) -> list[dict]:
    image = {"type": "image_url", "image_url": {"url": _png_url(), "detail": "low"}}
    return [{"role": "user", "content": [{"type": "text", "text": "What is in this picture?"}, *[image] * num_images]}]


@pytest.mark.parametrize("stream", [False, True])
async def test_an_image_to_a_text_only_model_is_a_400_that_names_why(async_openai_client, model_name, stream):
    with pytest.raises(openai.BadRequestError) as err:
        await async_openai_client.chat.completions.create(model=model_name, messages=_messages(1), max_tokens=4,
                                                          stream=stream)
    assert err.value.status_code == 400
    assert f"The model {model_name!r} does not take image inputs (LlamaForCausalLM)" in err.value.message


async def test_more_images_than_the_limit_is_vllms_400(async_openai_client, model_name):
    with pytest.raises(openai.BadRequestError) as err:
        await async_openai_client.chat.completions.create(model=model_name, messages=_messages(1000), max_tokens=4)
    assert "At most 999 image(s) may be provided in one prompt." in err.value.message


async def test_an_image_part_without_a_url_is_a_400(async_openai_client, model_name):
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"detail": "high"}}]}]
    with pytest.raises(openai.BadRequestError) as err:
        await async_openai_client.chat.completions.create(model=model_name, messages=messages, max_tokens=4)
    assert "url" in err.value.message


async def test_the_responses_api_reads_input_image_and_refuses_other_parts(async_openai_client, model_name):
    image = {"type": "input_image", "image_url": _png_url(), "detail": "auto"}
    with pytest.raises(openai.BadRequestError) as err:
        await async_openai_client.responses.create(model=model_name, max_output_tokens=4, input=[
            {"role": "user", "content": [{"type": "input_text", "text": "Describe it."}, image]}])
    assert "does not take image inputs" in err.value.message  # read, not dropped as before
    with pytest.raises(openai.BadRequestError) as err:
        await async_openai_client.responses.create(model=model_name, max_output_tokens=4, input=[
            {"role": "user", "content": [{"type": "input_file", "file_id": "file-1"}]}])
    assert "content[0].type 'input_file' is not supported" in err.value.message


def test_tokenize_with_an_image_is_a_400(stack, model_name):
    r = httpx.post(stack.base_url + "/tokenize", json={"model": model_name, "messages": _messages(1)}, timeout=30)
    assert r.status_code == 400 and "does not take image inputs" in r.json()["error"]["message"]
