"""The API end to end with the official `openai` client, against real services and the real model."""

from __future__ import annotations

import httpx
import openai
import pytest

pytestmark = pytest.mark.stack

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_chat_answers_paris(openai_client, model_name):
    r = openai_client.chat.completions.create(model=model_name, messages=QUESTION, max_tokens=30, temperature=0)
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"
    assert r.object == "chat.completion" and r.model == model_name and r.id.startswith("chatcmpl-")
    u = r.usage
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens == 37 and 1 <= u.completion_tokens <= 30


def test_chat_stream_matches_whole_and_usage_adds_up(openai_client, model_name):
    whole = openai_client.chat.completions.create(model=model_name, messages=QUESTION, max_tokens=30, temperature=0)
    chunks = list(openai_client.chat.completions.create(
        model=model_name, messages=QUESTION, max_tokens=30, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    usage = chunks[-1].usage
    assert chunks[-1].choices == []
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens == 32  # the same 37-token prompt, 2 full blocks
    extra = usage.model_extra
    assert extra["ttft"] > 0 and extra["tps"] > 0
    t = extra["timings"]  # the latency breakdown, in order along the request's path
    assert 0 < t["received"] <= t["submitted"] and t["received"] <= t["scheduled"] <= t["first_token"]
    assert t["first_token"] <= t["first_byte"]
    assert t["engine_ttft"] == pytest.approx(t["first_token"] - t["received"], abs=1e-5)


def test_completion_whole_and_streamed(openai_client, model_name):
    kwargs = dict(model=model_name, prompt="The capital of France is", max_tokens=12, temperature=0)
    whole = openai_client.completions.create(**kwargs)
    assert "Paris" in whole.choices[0].text
    assert whole.object == "text_completion"
    assert whole.usage.prompt_tokens == 5
    assert whole.usage.completion_tokens == 12 and whole.choices[0].finish_reason == "length"
    streamed = list(openai_client.completions.create(**kwargs, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text
    assert streamed[-1].choices[0].finish_reason == "length"


def test_stop_string_is_not_returned(openai_client, model_name):
    r = openai_client.completions.create(model=model_name, prompt="The capital of France is", max_tokens=12,
                                         temperature=0, stop=["."])
    assert r.choices[0].text == " Paris" and r.choices[0].finish_reason == "stop"


def test_prompt_as_token_ids(openai_client, model_name, hf_tokenizer):
    ids = hf_tokenizer.encode("The capital of France is")
    by_ids = openai_client.completions.create(model=model_name, prompt=ids, max_tokens=6, temperature=0)
    by_text = openai_client.completions.create(model=model_name, prompt="The capital of France is",
                                               max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text


def test_seeded_sampling_is_reproducible(openai_client, model_name):
    kwargs = dict(model=model_name, prompt="Once upon a time", max_tokens=16, temperature=1.0, top_p=0.9, seed=1234)
    a = openai_client.completions.create(**kwargs).choices[0].text
    b = openai_client.completions.create(**kwargs).choices[0].text
    other = openai_client.completions.create(**{**kwargs, "seed": 4321}).choices[0].text
    assert a == b and a != other  # the seed is what fixes the draws


def test_unknown_model_is_404(openai_client):
    with pytest.raises(openai.NotFoundError) as err:
        openai_client.completions.create(model="no-such-model", prompt="hi")
    assert err.value.body["type"] == "not_found_error"


def test_over_context_is_400_naming_both_numbers(openai_client, model_name):
    with pytest.raises(openai.BadRequestError) as err:
        openai_client.completions.create(model=model_name, prompt="hello there", max_tokens=9000)
    assert "8192" in err.value.message and "9002" in err.value.message


def test_bad_bodies_are_400_with_openai_shape(stack, model_name):
    url = stack.base_url + "/v1/completions"
    cases = [
        b"{not json",
        b'{"model": "%s", "prompt": 5}' % model_name.encode(),
        b'{"model": "%s", "prompt": "x", "max_tokens": "many"}' % model_name.encode(),
        b'{"model": "%s", "prompt": "x", "temperature": -1}' % model_name.encode(),
        b'{"model": 7, "prompt": "x"}',  # (a body with no model takes the one served: vLLM's rule)
    ]
    for body in cases:
        r = httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == 400, body
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    # and the server still answers
    ok = httpx.post(url, json={"model": model_name, "prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_models_and_health(stack, model_name):
    assert httpx.get(stack.base_url + "/health").status_code == 200
    models = httpx.get(stack.base_url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == [model_name]
    assert models["data"][0]["architectures"] == ["LlamaForCausalLM"]  # as its worker loaded it


def test_chat_stream_finish_reason_rides_on_the_last_content_chunk(openai_client, model_name):
    """As vLLM and the product's examples send it: no empty chunk after the text."""
    chunks = list(openai_client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=6, stream=True,
        extra_body={"ignore_eos": True}))
    with_choices = [c for c in chunks if c.choices]
    assert with_choices[-1].choices[0].finish_reason == "length" and with_choices[-1].choices[0].delta.content
    assert all(c.choices[0].finish_reason is None for c in with_choices[:-1])
