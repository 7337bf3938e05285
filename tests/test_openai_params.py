"""Every sampling parameter has an effect, checked through the real stack with the `openai` client."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

pytestmark = pytest.mark.stack

PROMPT = "The capital of France is"
COUNTING = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,"


@pytest.fixture(scope="module")
def tokenize(stack, model_name):
    def ids(text: str) -> list[int]:
        return httpx.post(stack.base_url + "/tokenize", json={"model": model_name, "prompt": text}).json()["tokens"]
    return ids


def complete(client, model, prompt=PROMPT, **kw):
    kw.setdefault("max_tokens", 8)
    kw.setdefault("temperature", 0)
    return client.completions.create(model=model, prompt=prompt, **kw)


def test_n_gives_n_indexed_choices_whole_and_streamed(openai_client, model_name):
    r = complete(openai_client, model_name, n=3, temperature=1.0, seed=5, max_tokens=6)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.text for c in r.choices}) > 1  # each choice draws on its own
    assert r.usage.prompt_tokens == 5  # the prompt counts once, however many choices
    assert 3 <= r.usage.completion_tokens <= 18  # every choice's tokens add up
    chunks = list(complete(openai_client, model_name, n=3, temperature=1.0, seed=5, max_tokens=6, stream=True))
    texts = {i: "".join(c.choices[0].text for c in chunks if c.choices[0].index == i) for i in range(3)}
    assert texts == {c.index: c.text for c in r.choices}  # same seed, same draws, streamed or not
    finished = [c.choices[0].index for c in chunks if c.choices[0].finish_reason]
    assert sorted(finished) == [0, 1, 2]


def test_chat_n_streams_one_index_per_choice(openai_client, model_name):
    chunks = list(openai_client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "Say hi"}], n=2, max_tokens=4, stream=True))
    assert {c.choices[0].index for c in chunks} == {0, 1}
    assert [c.choices[0].delta.role for c in chunks[:2]] == ["assistant", "assistant"]


async def test_seed_fixes_the_text_whatever_else_is_in_the_batch(async_openai_client, model_name):
    kw = dict(model=model_name, prompt="Once upon a time", max_tokens=16, temperature=1.0, seed=77)
    alone = (await async_openai_client.completions.create(**kw)).choices[0].text
    others = [async_openai_client.completions.create(model=model_name, prompt=f"Story {i}:", max_tokens=16,
                                                     temperature=1.0) for i in range(4)]
    together = await asyncio.gather(async_openai_client.completions.create(**kw), *others)
    assert together[0].choices[0].text == alone


def test_narrow_sampling_equals_greedy(openai_client, model_name):
    greedy = complete(openai_client, model_name, max_tokens=10).choices[0].text
    for kw in ({"extra_body": {"top_k": 1}}, {"top_p": 0.01}, {"extra_body": {"min_p": 1.0}}):
        hot = complete(openai_client, model_name, max_tokens=10, temperature=1.5, seed=3, **kw)
        assert hot.choices[0].text == greedy, kw
    wild = {complete(openai_client, model_name, max_tokens=10, temperature=2.0, seed=s).choices[0].text
            for s in range(3)}
    assert wild != {greedy}  # while a high temperature alone strays from greedy


def num_repeats(client, model, prompt, **kw) -> int:
    """Output tokens that are repeats of an earlier output token."""
    tokens = complete(client, model, prompt, max_tokens=32, logprobs=0, **kw).choices[0].logprobs.tokens
    return len(tokens) - len(set(tokens))


def test_penalties_discourage_repeats(openai_client, model_name):
    # counting is so sure of itself that only a penalty growing with each repeat bends it
    cases = [(COUNTING, {"frequency_penalty": 2.0}), (COUNTING, {"extra_body": {"repetition_penalty": 1.8}}),
             ("Once upon a time", {"presence_penalty": 2.0})]
    for prompt, kw in cases:
        assert num_repeats(openai_client, model_name, prompt, **kw) < num_repeats(openai_client, model_name, prompt), \
            (prompt, kw)


def test_logit_bias_bans_and_forces_tokens(openai_client, model_name, tokenize):
    paris = tokenize(" Paris")
    assert len(paris) == 1
    banned = complete(openai_client, model_name, logit_bias={str(paris[0]): -100}).choices[0].text
    assert not banned.startswith(" Paris")
    forced = complete(openai_client, model_name, prompt="Hello", max_tokens=3, logit_bias={str(paris[0]): 100})
    assert forced.choices[0].text == " Paris" * 3


def test_token_limits_and_eos(openai_client, model_name):
    question = [{"role": "user", "content": "What is the capital of France?"}]
    r = openai_client.chat.completions.create(model=model_name, messages=question, max_completion_tokens=3)
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"
    short = openai_client.chat.completions.create(model=model_name, messages=question, temperature=0)
    assert short.choices[0].finish_reason == "stop" and short.usage.completion_tokens < 20
    longer = openai_client.chat.completions.create(model=model_name, messages=question, temperature=0,
                                                   max_tokens=60, extra_body={"min_tokens": 30})
    assert longer.usage.completion_tokens >= 30
    forced = openai_client.chat.completions.create(model=model_name, messages=question, temperature=0,
                                                   max_tokens=40, extra_body={"ignore_eos": True})
    assert forced.usage.completion_tokens == 40 and forced.choices[0].finish_reason == "length"


def test_stop_strings_and_stop_token_ids_are_not_returned(openai_client, model_name, tokenize):
    text = complete(openai_client, model_name, max_tokens=12).choices[0].text  # " Paris. ..."
    assert text.startswith(" Paris.")
    for stop in (".", [".", "xyz"]):
        r = complete(openai_client, model_name, max_tokens=12, stop=stop)
        assert r.choices[0].text == " Paris" and r.choices[0].finish_reason == "stop"
    dot = tokenize(".")
    r = complete(openai_client, model_name, max_tokens=12, extra_body={"stop_token_ids": dot})
    assert r.choices[0].text == " Paris" and r.choices[0].finish_reason == "stop"
    assert complete(openai_client, model_name, max_tokens=12, user="someone").choices[0].text == text  # accepted


def test_prompt_lists_give_one_choice_set_per_prompt(openai_client, model_name, tokenize):
    one = complete(openai_client, model_name).choices[0].text
    two = complete(openai_client, model_name, prompt="1, 2, 3,").choices[0].text
    r = complete(openai_client, model_name, prompt=[PROMPT, "1, 2, 3,"], n=2)
    assert [c.text for c in r.choices] == [one, one, two, two]
    ids = tokenize(PROMPT)
    by_ids = complete(openai_client, model_name, prompt=[ids, ids])
    assert [c.text for c in by_ids.choices] == [one, one]
    assert by_ids.usage.prompt_tokens == 2 * len(ids)


def plain_messages() -> list[dict]:
    return [{"role": "user", "content": "What is the capital of France?"}]


def test_chat_content_parts_roles_and_unknown_fields(openai_client, model_name):
    plain = openai_client.chat.completions.create(
        model=model_name, temperature=0, max_tokens=8,
        messages=[{"role": "user", "content": "What is the capital of France?"}])
    parts = openai_client.chat.completions.create(
        model=model_name, temperature=0, max_tokens=8,
        messages=[{"role": "user", "content": [{"type": "text", "text": "What is the capital "},
                                               {"type": "text", "text": "of France?"}]}])
    assert parts.choices[0].message.content == plain.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="Unrecognized request argument supplied: some_future_field"):
        openai_client.chat.completions.create(model=model_name, max_tokens=8, messages=plain_messages(),
                                              extra_body={"some_future_field": {"x": 1}})
    r = openai_client.chat.completions.create(model=model_name, max_tokens=4, messages=[
        {"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."}, {"role": "tool", "content": "42", "tool_call_id": "t1"},
        {"role": "user", "content": "Thanks"}])
    assert r.choices[0].message.role == "assistant"


def test_the_end_user_is_logged_with_the_request(stack, openai_client, model_name):
    """OpenAI's `user` identifies the end user for monitoring: it is on the request's log line (the
    line is written before a whole response is returned)."""
    import json

    openai_client.completions.create(model=model_name, prompt="Hi", max_tokens=2, user="alice-42")
    lines = [json.loads(line) for line in (stack.log_dir / "api.log").read_text().splitlines()
             if line.startswith("{") and '"request_finished"' in line]
    assert any(line.get("user") == "alice-42" for line in lines)
