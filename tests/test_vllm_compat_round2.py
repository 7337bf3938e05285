"""What vLLM's own OpenAI-server tests (test_basic, test_completion, test_chat, test_tokenization,
test_return_tokens_as_ids, test_prompt_validation) found missing, asked of the stack with the openai
client: null keys vLLM always sends, stop_reason, no model name, custom roles, /tokenize's
vocabulary strings and options, the chosen token first in top_logprobs, vLLM's error words, and
beam search (against transformers' own)."""

from __future__ import annotations

import httpx
import openai
import pytest

pytestmark = pytest.mark.stack
GREEDY = {"temperature": 0, "max_tokens": 8}


def test_the_null_keys_vllm_always_sends(openai_client, model_name, stack):
    completion = openai_client.completions.create(model=model_name, prompt="The capital of France is", **GREEDY)
    assert completion.system_fingerprint is None and completion.choices[0].prompt_logprobs is None
    chat = openai_client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "Hi"}],
                                                 **GREEDY)
    assert chat.system_fingerprint is None and chat.prompt_logprobs is None
    body = {"model": model_name, "prompt": "The capital of France is", **GREEDY}
    invoked = httpx.post(stack.base_url + "/invocations", json=body, timeout=60).json()
    assert invoked.keys() == httpx.post(stack.base_url + "/v1/completions", json=body, timeout=60).json().keys()
    assert {"service_tier", "system_fingerprint"} <= invoked.keys()
    assert {"stop_reason", "prompt_logprobs"} <= invoked["choices"][0].keys()


def test_stop_reason_names_the_stop_string_or_token_that_ended_the_text(openai_client, model_name, stack):
    free = openai_client.completions.create(model=model_name, prompt="The capital of France is", **GREEDY)
    assert free.choices[0].finish_reason == "length" and free.choices[0].stop_reason is None
    word = free.choices[0].text.split()[1]
    stopped = openai_client.completions.create(model=model_name, prompt="The capital of France is", stop=[word],
                                               **GREEDY)
    assert stopped.choices[0].finish_reason == "stop" and stopped.choices[0].stop_reason == word
    streamed = [c.choices[0] for c in openai_client.completions.create(
        model=model_name, prompt="The capital of France is", stop=[word], stream=True, **GREEDY) if c.choices]
    assert streamed[-1].finish_reason == "stop" and streamed[-1].stop_reason == word
    as_ids = openai_client.completions.create(model=model_name, prompt="The capital of France is", logprobs=0,
                                              extra_body={"return_tokens_as_token_ids": True}, **GREEDY)
    second = int(as_ids.choices[0].logprobs.tokens[1].removeprefix("token_id:"))
    by_token = openai_client.chat.completions.create(  # a chat: the same rule
        model=model_name, messages=[{"role": "user", "content": "Go on: The capital of France is"}],
        extra_body={"stop_token_ids": [second]}, temperature=0, max_tokens=64)
    by_id = openai_client.completions.create(model=model_name, prompt="The capital of France is",
                                             extra_body={"stop_token_ids": [second]}, **GREEDY)
    assert by_id.choices[0].finish_reason == "stop" and by_id.choices[0].stop_reason == second
    assert (by_token.choices[0].stop_reason == second) == (by_token.choices[0].finish_reason == "stop")


@pytest.mark.parametrize("name", ["", None])
def test_no_model_name_is_the_stacks_own_model(stack, model_name, name):
    body = {"prompt": "Hello", "max_tokens": 2} | ({"model": name} if name is not None else {})
    reply = httpx.post(stack.base_url + "/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200 and reply.json()["model"] == model_name


def test_a_custom_role_and_a_messages_extra_field_reach_the_template(openai_client, model_name, stack):
    messages = [{"role": "my-custom-role", "content": "Hello", "my_field": "kept for the template"}]
    reply = openai_client.chat.completions.create(model=model_name, messages=messages, max_tokens=2)
    assert reply.choices[0].message.role == "assistant"
    rendered = httpx.post(stack.base_url + "/tokenize", json={"model": model_name, "messages": messages},
                          timeout=30).json()
    text = httpx.post(stack.base_url + "/detokenize", json={"model": model_name, "tokens": rendered["tokens"]},
                      timeout=30).json()["prompt"]
    assert "my-custom-role" in text and rendered["count"] == reply.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError, match="Unrecognized request argument supplied: my_field"):
        openai_client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=2, extra_body={"my_field": 1})  # the request's own: refused


def test_tokenize_gives_vocabulary_strings_and_takes_vllms_options(openai_client, model_name, stack):
    def tokenize(**body) -> dict:
        reply = httpx.post(stack.base_url + "/tokenize", json={"model": model_name, **body}, timeout=30)
        assert reply.status_code == 200, reply.text
        return reply.json()

    got = tokenize(prompt="The capital is", return_token_strs=True)
    assert got["token_strs"] == ["The", "Ġcapital", "Ġis"] and got["count"] == 3
    assert tokenize(prompt="The capital is", add_special_tokens=False)["tokens"] == got["tokens"]
    assert tokenize(prompt="The capital is")["token_strs"] is None  # asked for or null, as vLLM answers
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    with_tools = tokenize(messages=messages, tools=[tool])
    assert with_tools["count"] > tokenize(messages=messages)["count"]
    chat = openai_client.chat.completions.create(model=model_name, messages=messages, tools=[tool], max_tokens=1)
    assert with_tools["count"] == chat.usage.prompt_tokens


def test_the_chosen_token_comes_first_in_top_logprobs_with_token_ids_and_echo(stack, model_name):
    body = {"model": model_name, "prompt": "The capital of France is", "max_tokens": 6, "temperature": 1.5,
            "seed": 7, "logprobs": 3, "echo": True, "return_tokens_as_token_ids": True}
    lp = httpx.post(stack.base_url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["logprobs"]
    generated = [(t, top) for t, top in zip(lp["tokens"], lp["top_logprobs"], strict=True) if top is not None]
    assert len(generated) >= 6 and all(t.startswith("token_id:") for t, _ in generated)
    assert all(next(iter(top)) == token for token, top in generated)
    assert any(len(top) == 4 for _, top in generated)  # a sampled token outside the top 3: it is added, first


def test_vllms_error_words_for_an_empty_prompt_an_unknown_token_and_a_seed_out_of_range(openai_client, model_name):
    with pytest.raises(openai.BadRequestError, match="decoder prompt cannot be empty"):
        openai_client.completions.create(model=model_name, prompt="", max_tokens=5)
    with pytest.raises(openai.BadRequestError, match="Either prompt or prompt_embeds must be provided and non-empty"):
        openai_client.completions.create(model=model_name, prompt=None, max_tokens=5)
    with pytest.raises(openai.BadRequestError, match="out of vocabulary"):
        openai_client.completions.create(model=model_name, prompt=[999999], max_tokens=5)
    for seed in (2**63, -(2**63) - 1):
        with pytest.raises(openai.BadRequestError, match="less_than_equal"):
            openai_client.completions.create(model=model_name, prompt="Hi", max_tokens=5, seed=seed)


def test_beam_search_finds_the_beams_transformers_finds(openai_client, model_name, hf_model, hf_tokenizer):
    """length_penalty 0: a beam's score is its summed logprob in vLLM's search and in transformers'. A
    story's middle: no end of sequence among the candidates, where the two searches differ (vLLM's
    finishes a beam on any of the 2n candidates, transformers' on the n best)."""
    import torch

    prompt = "Once upon a time, in a small village by the sea, there lived"
    reply = openai_client.completions.create(model=model_name, prompt=prompt, n=3, max_tokens=5, temperature=0,
                                             extra_body={"use_beam_search": True, "length_penalty": 0.0})
    ids = torch.tensor([hf_tokenizer.encode(prompt)])
    with torch.no_grad():
        out = hf_model.generate(ids, num_beams=3, num_return_sequences=3, max_new_tokens=5, do_sample=False,
                                length_penalty=0.0, early_stopping=False)
    expected = [hf_tokenizer.decode(seq[ids.shape[1]:], skip_special_tokens=True) for seq in out]
    assert [c.text for c in reply.choices] == expected and len(set(expected)) == 3
    assert all(c.finish_reason == "length" for c in reply.choices)


def test_beam_search_as_vllms_test_asks_it_whole_and_streamed(openai_client, model_name):
    batch = openai_client.completions.create(model=model_name, prompt=["Hello, my name is"] * 2, n=2, max_tokens=5,
                                             temperature=0, extra_body={"use_beam_search": True})
    texts = [c.text for c in sorted(batch.choices, key=lambda c: c.index)]
    assert len(texts) == 4 and texts[0] != texts[1] and texts[:2] == texts[2:]
    assert 0 < batch.usage.completion_tokens <= 4 * 5  # the returned beams' tokens
    streamed = {}
    for chunk in openai_client.completions.create(model=model_name, prompt="Hello, my name is", n=2, max_tokens=5,
                                                  temperature=0, stream=True, extra_body={"use_beam_search": True}):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert [streamed[0], streamed[1]] == texts[:2]
    chat = openai_client.chat.completions.create(model=model_name, n=2, max_tokens=6, temperature=0,
                                                 messages=[{"role": "user", "content": "Name a colour."}],
                                                 extra_body={"use_beam_search": True})
    assert len(chat.choices) == 2 and chat.choices[0].message.content != chat.choices[1].message.content


def test_return_token_ids_gives_the_prompts_and_each_choices_ids(openai_client, model_name, hf_tokenizer):
    """vLLM's return_token_ids: null keys unless asked; the ids decode to the text (a chat's end with
    the end-of-turn token that stopped it); streamed, the prompt's ids come once, first."""
    prompt = "Repeat after me: I love cats 🐱"
    plain = openai_client.completions.create(model=model_name, prompt=prompt, **GREEDY)
    assert plain.choices[0].token_ids is None and plain.choices[0].prompt_token_ids is None
    asked = openai_client.completions.create(model=model_name, prompt=prompt, echo=True,
                                             extra_body={"return_token_ids": True}, **GREEDY)
    choice = asked.choices[0]
    assert choice.prompt_token_ids == hf_tokenizer.encode(prompt) and len(choice.token_ids) == 8
    assert choice.text.startswith(prompt)  # the ids hold a character the text waits to complete
    assert hf_tokenizer.decode(choice.token_ids).startswith(choice.text[len(prompt):])
    streamed = [c.choices[0] for c in openai_client.completions.create(
        model=model_name, prompt=prompt, stream=True, extra_body={"return_token_ids": True}, **GREEDY)]
    assert streamed[0].prompt_token_ids == choice.prompt_token_ids
    assert all(getattr(c, "prompt_token_ids", None) is None for c in streamed[1:])
    assert [t for c in streamed for t in c.token_ids] == choice.token_ids

    messages = [{"role": "user", "content": prompt}]
    chat = openai_client.chat.completions.create(model=model_name, messages=messages, temperature=0, max_tokens=40,
                                                 extra_body={"return_token_ids": True})
    assert chat.choices[0].finish_reason == "stop"
    assert hf_tokenizer.decode(chat.choices[0].token_ids) == chat.choices[0].message.content + "<|im_end|>"
    assert hf_tokenizer.decode(chat.prompt_token_ids).endswith("I love cats 🐱<|im_end|>\n<|im_start|>assistant\n")
    chunks = list(openai_client.chat.completions.create(model=model_name, messages=messages, temperature=0,
                                                        max_tokens=40, stream=True,
                                                        extra_body={"return_token_ids": True}))
    assert chunks[0].prompt_token_ids == chat.prompt_token_ids
    assert all("prompt_token_ids" not in c.model_dump() for c in chunks[1:])
    ids = [t for c in chunks if c.choices and "token_ids" in c.choices[0].model_dump()
           for t in c.choices[0].token_ids]
    assert ids == chat.choices[0].token_ids
    without = openai_client.chat.completions.create(model=model_name, messages=messages, **GREEDY)
    assert without.prompt_token_ids is None and without.choices[0].token_ids is None


def test_chat_echo_puts_the_final_assistant_message_first(openai_client, model_name):
    """vLLM's chat `echo` with continue_final_message: the answer's content starts with the message it continues."""
    saying = "Here is a common saying about apple. An apple a day, keeps"
    messages = [{"role": "user", "content": "tell me a common saying"}, {"role": "assistant", "content": saying}]
    body = {"continue_final_message": True, "add_generation_prompt": False}
    plain = openai_client.chat.completions.create(model=model_name, messages=messages, temperature=0, max_tokens=12,
                                                  extra_body=body)
    echoed = openai_client.chat.completions.create(model=model_name, messages=messages, temperature=0,
                                                   max_tokens=12, extra_body={**body, "echo": True})
    assert echoed.choices[0].message.content == saying + plain.choices[0].message.content
    streamed = [c.choices[0].delta.content or "" for c in openai_client.chat.completions.create(
        model=model_name, messages=messages, temperature=0, max_tokens=12, stream=True,
        extra_body={**body, "echo": True}) if c.choices]
    assert "".join(streamed) == echoed.choices[0].message.content and streamed[1] == saying


def test_truncate_prompt_tokens_keeps_the_side_asked(openai_client, model_name):
    """vLLM's truncate_prompt_tokens with truncation_side: the first k ids (right) or the last k (left)."""
    ids = list(range(100, 108))
    for side, kept in (("right", ids[:4]), ("left", ids[-4:]), (None, ids[:4])):
        extra = {"return_token_ids": True, "truncate_prompt_tokens": 4} | ({"truncation_side": side} if side else {})
        reply = openai_client.completions.create(model=model_name, prompt=ids, max_tokens=1, temperature=0,
                                                 extra_body=extra)
        assert reply.choices[0].prompt_token_ids == kept and reply.usage.prompt_tokens == 4
    chat = openai_client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "Hi there"}],
                                                 max_tokens=1, extra_body={"truncate_prompt_tokens": 3,
                                                                           "return_token_ids": True})
    assert len(chat.prompt_token_ids) == 3
    with pytest.raises(openai.BadRequestError, match="truncation_side needs truncate_prompt_tokens"):
        openai_client.completions.create(model=model_name, prompt="Hi", max_tokens=1,
                                         extra_body={"truncation_side": "left"})
