"""Logprobs (completions and chat), echo with prompt logprobs, and constrained JSON output."""

from __future__ import annotations

import json
import math

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.stack

PROMPT = "The capital of France is"


def test_completion_logprobs_shape_and_greedy_consistency(openai_client, model_name):
    r = openai_client.completions.create(model=model_name, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert value <= 0 and len(top) == 3
        assert max(top, key=top.get) == token  # greedy: the sampled token is the most likely one
        assert math.isclose(top[token], value)


def test_echo_gives_prompt_logprobs_first_null(openai_client, model_name):
    """What lm-evaluation-harness's loglikelihood asks: echo + logprobs + max_tokens=1."""
    r = openai_client.completions.create(model=model_name, prompt=PROMPT + " Paris", max_tokens=1, temperature=0,
                                         echo=True, logprobs=1)
    choice = r.choices[0]
    lp = choice.logprobs
    assert choice.text.startswith(PROMPT + " Paris")
    assert len(lp.tokens) == r.usage.prompt_tokens + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert lp.tokens[:6] == ["The", " capital", " of", " France", " is", " Paris"]
    assert lp.token_logprobs[5] > -1.0  # " Paris" is likely after "The capital of France is"
    # the same prompt scored twice gives the same numbers (no prefix cache under prompt logprobs)
    again = openai_client.completions.create(model=model_name, prompt=PROMPT + " Paris", max_tokens=1,
                                             temperature=0, echo=True, logprobs=1).choices[0].logprobs
    assert again.token_logprobs == lp.token_logprobs


def test_echo_without_logprobs_prepends_the_prompt(openai_client, model_name):
    plain = openai_client.completions.create(model=model_name, prompt=PROMPT, max_tokens=4, temperature=0)
    echoed = openai_client.completions.create(model=model_name, prompt=PROMPT, max_tokens=4, temperature=0,
                                              echo=True)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text


def test_chat_logprobs_with_top_alternatives(openai_client, model_name):
    r = openai_client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for item in content:
        assert bytes(item.bytes).decode(errors="replace") == item.token
        assert len(item.top_logprobs) == 2 and item.top_logprobs[0].token == item.token
    plain = openai_client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_logprobs_above_the_cap_are_refused(openai_client, model_name):
    with pytest.raises(openai.BadRequestError, match="greater than max allowed: 20"):
        openai_client.completions.create(model=model_name, prompt=PROMPT, max_tokens=1, logprobs=21)
    with pytest.raises(openai.BadRequestError, match="greater than max allowed: 20"):
        openai_client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "x"}],
                                              max_tokens=1, logprobs=True, top_logprobs=21)
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs of 49152, which is greater than max allowed"):
        openai_client.completions.create(model=model_name, prompt=PROMPT, max_tokens=1,
                                         extra_body={"prompt_logprobs": -1})  # vLLM's -1: the whole vocabulary


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"type": "string", "enum": ["cat", "dog", "fish"]}, "maxItems": 3},
    },
    "required": ["name", "age", "pets"],
    "additionalProperties": False,
}


def test_json_schema_output_always_validates(openai_client, model_name):
    """24 sampled choices at temperature 1: every one parses and validates against the schema."""
    r = openai_client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "Describe a person as JSON."}],
        n=24, seed=11, temperature=1.0, max_tokens=80,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    assert len(r.choices) == 24
    for choice in r.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_json_object_mode_gives_an_object(openai_client, model_name):
    for seed in range(3):
        r = openai_client.completions.create(
            model=model_name, prompt="A JSON object describing Paris:", seed=seed, max_tokens=150,
            extra_body={"response_format": {"type": "json_object"}})
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(r.choices[0].text), dict)
        else:  # cut by max_tokens: still a prefix of an object
            assert r.choices[0].text.startswith("{")


def test_bad_schema_is_400(openai_client, model_name):
    with pytest.raises(openai.BadRequestError, match="invalid JSON schema"):
        openai_client.chat.completions.create(
            model=model_name, messages=[{"role": "user", "content": "x"}], max_tokens=4,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}})
